"""``Trainer(config).fit`` with ``cluster.launcher: ray``: the workers are Ray actors.

From a driver or notebook attached to a Ray cluster (``ray.init(address=...)``; without
one, ``ray.init()`` starts a local Ray), ``fit`` starts a :class:`RayExecutor` of
``cluster.workers`` workers and ``cluster.servers`` servers, sends the model, data and
callbacks to every worker (cloudpickle, as the local cluster does), runs one rank of
``fit`` there and, as the local cluster does, loads rank 0's trained weights and
callback states into the caller's objects and returns rank 0's history. The ``comm``
section reaches every role as its ``BPSTRAIN_*`` variables. Run folders are written by
rank 0 on its node (``trainer.out_dir`` should be shared storage on a real cluster).
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from bpstrain.config.schema import comm_knobs
from bpstrain.errors import ConfigError


def _env_value(value: Any) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def comm_env(options: dict) -> dict:
    """The ``comm`` options as the environment variables that set them (secret aside)."""
    knobs = comm_knobs()
    return {knobs[key][1].env[0]: _env_value(value) for key, value in options.items()
            if key in knobs and knobs[key][1].env}


def _fit_rank(blob: bytes) -> dict:
    """One rank of the job, in a worker actor (the engine is up: the executor joined it)."""
    from bpstrain.trainer._child import pack_weights
    from bpstrain.trainer._shipping import load_job
    from bpstrain.trainer.trainer import Trainer

    config, callbacks, model, data, val_data = load_job(blob)
    trainer = Trainer(config, callbacks)
    history = trainer.fit_rank(model, data, val_data, None, joined=True)
    return {"history": history.to_dict(),
            "callbacks": [cb.state_dict() for cb in trainer.callbacks],
            "weights": pack_weights(model) if trainer.is_global_zero else None}


def fit_on_ray(trainer, model: Any, data: Any, val_data: Any):
    """Runs ``trainer.fit`` on Ray actors; returns rank 0's :class:`History`."""
    from bpstrain.ray import RayExecutor
    from bpstrain.trainer._child import unpack_weights
    from bpstrain.trainer._shipping import dump_job
    from bpstrain.trainer.history import History
    from bpstrain.trainer.trainer import comm_options

    cfg = trainer.config.cluster
    if cfg.local_size is not None:
        raise ConfigError("cluster.local_size does not apply with cluster.launcher=ray (each "
                          "worker is a Ray actor, its Ray node its host); leave it null. "
                          f"Received: cluster.local_size={cfg.local_size}")
    config = OmegaConf.to_container(trainer.config, resolve=True)
    config["trainer"]["run_name"] = trainer.run_name  # the folder named here
    try:
        blob = dump_job((config, trainer.callbacks, model, data, val_data))
    except Exception as exc:
        raise TypeError(
            "Trainer.fit with cluster.launcher=ray sends the model, data and callbacks to Ray "
            "actors, so they must be picklable (cloudpickle). Pass data as a callable that "
            f"builds it. Received: {type(exc).__name__}: {exc}") from exc
    options = comm_options(trainer.config)
    settings = RayExecutor.create_settings(
        timeout_s=float(trainer.config.comm.rendezvous_timeout), env=comm_env(options),
        secret=options.get("secret"))
    with RayExecutor(settings, num_workers=cfg.workers, num_servers=cfg.servers) as executor:
        results = executor.run(_fit_rank, args=(blob,))
    rank0 = results[0]
    unpack_weights(model, rank0["weights"])
    for cb, state in zip(trainer.callbacks, rank0["callbacks"]):
        cb.load_state_dict(state)
    trainer.history = History.from_dict(rank0["history"])
    return trainer.history
