"""``Trainer(config).fit(model, data)``: one funnel for notebooks, scripts and launched jobs.

Where ``fit`` runs is decided once, by :func:`launch_mode`:

* ``DMLC_ROLE=worker`` in the environment (``python -m bpstrain.launch ... -- python
  train.py``): this process is one rank of the job.
* ``cluster.workers == 1``: train in this process, no cluster.
* otherwise (a notebook, a plain script): bring up a local cluster in child processes
  (:mod:`bpstrain.trainer._local_cluster`), one progress bar here, and the trained
  weights loaded back into ``model``.

Example:
    >>> from bpstrain.trainer import Trainer
    >>> from bpstrain.models import get_model, digits_dataset
    >>> trainer = Trainer({"trainer.epochs": 3, "cluster.workers": 2})
    >>> history = trainer.fit(get_model("digits_mlp"), digits_dataset("train"),
    ...                       val_data=digits_dataset("test"))  # doctest: +SKIP
    >>> history.plot()  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from omegaconf import DictConfig, OmegaConf

from bpstrain.config import ConfigError, load_config
from bpstrain.config.schema import CommConfig
from bpstrain.trainer import callbacks as cbs
from bpstrain.trainer._dispatch import fire, ordered
from bpstrain.trainer.history import History


def launch_mode(config: DictConfig, environ=None) -> str:
    """``"rank"`` (inside a launched job), ``"in_process"`` or ``"local_cluster"``."""
    environ = os.environ if environ is None else environ
    role = environ.get("DMLC_ROLE")
    if role == "worker":
        return "rank"
    if role:
        raise ConfigError("Trainer.fit runs in worker processes; scheduler and server processes "
                          f"run `python -m bpstrain.launch`. Received: DMLC_ROLE={role}")
    return "in_process" if config.cluster.workers == 1 else "local_cluster"


def is_keras_model(model: Any) -> bool:
    """True for Keras models, checked without importing Keras."""
    return any(c.__module__.split(".")[0] in ("keras", "tf_keras") for c in type(model).__mro__)


def comm_options(config: DictConfig) -> Dict[str, Any]:
    """The ``comm`` keys that differ from the schema defaults (env vars fill the rest)."""
    defaults = OmegaConf.to_container(OmegaConf.structured(CommConfig))
    given = OmegaConf.to_container(config.comm, resolve=True)
    options = {k: v for k, v in given.items() if defaults.get(k) != v}
    if config.cluster.secret:
        options["secret"] = config.cluster.secret
    return options


def default_callbacks(config: DictConfig, given: Iterable[cbs.Callback] = ()) -> List[cbs.Callback]:
    """The built-ins the config asks for, except types already in ``given``; then ``given``."""
    t, o = config.trainer, config.optimizer
    wanted: List[cbs.Callback] = [cbs.MetricAveraging(), cbs.Throughput(verbose=t.throughput),
                                  cbs.LearningRateSchedule.from_config(o), cbs.CSVLogger()]
    if t.progress:
        wanted.append(cbs.ProgressBar())
    if t.early_stopping_patience:
        wanted.append(cbs.EarlyStopping(t.monitor, t.early_stopping_patience))
    if t.checkpoint_every:
        wanted.append(cbs.ModelCheckpoint(every_n_epochs=t.checkpoint_every))
    if t.timeline:
        wanted.append(cbs.CommTimeline())
    given = list(given)
    present = {type(cb) for cb in given}
    return [cb for cb in wanted if type(cb) not in present] + given


class Trainer:
    """Trains a torch ``nn.Module`` (or a Keras model) with the push_pull engine.

    Args:
        config: A :class:`bpstrain.config.Config`, a ``DictConfig``, a (dotted) dict,
            a YAML path or None; validated by :func:`bpstrain.config.load_config`.
        callbacks: Extra :class:`~bpstrain.trainer.Callback` objects. Built-ins the
            config enables are added unless one of the same type is given.

    Attributes (read by callbacks):
        config, callbacks, comm, rank, size, local_rank, is_global_zero, module,
        optimizer, current_epoch, global_step, epochs_completed, max_epochs,
        num_training_batches, logs, train_sums, val_sums, history, should_stop,
        resumed, out_dir, progress_sink.
    """

    def __init__(self, config: Any = None, callbacks: Optional[Iterable[cbs.Callback]] = None):
        self.config = load_config(config)
        self.callbacks = ordered(default_callbacks(self.config, callbacks or ()))
        self.progress_sink = None
        self._reset()

    def _reset(self) -> None:
        self.comm = None
        self.rank, self.size, self.local_rank = 0, 1, 0
        self.module = self.optimizer = None
        self.current_epoch = self.global_step = self.epochs_completed = 0
        self.num_training_batches = self.progress_step = self.last_batch_size = 0
        self.logs: Dict[str, Any] = {}
        self.train_sums = self.val_sums = None
        self.history = History()
        self.should_stop = self.resumed = False

    # ------------------------------------------------------------------------- properties

    @property
    def max_epochs(self) -> int:
        """``trainer.epochs`` of the config."""
        return int(self.config.trainer.epochs)

    @property
    def out_dir(self) -> Path:
        """``trainer.out_dir``: checkpoints, CSV and timeline go here."""
        return Path(self.config.trainer.out_dir)

    @property
    def is_global_zero(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

    def print(self, message: str) -> None:
        """Prints on rank 0 only (above the progress bar when there is one)."""
        if not self.is_global_zero:
            return
        if self.progress_sink is not None:
            self.progress_sink.write(message)
        else:
            print(message, flush=True)

    def callback(self, cls: type) -> Optional[cbs.Callback]:
        """The first callback of type ``cls``, or None."""
        return next((cb for cb in self.callbacks if isinstance(cb, cls)), None)

    # ---------------------------------------------------------------------------- fitting

    def fit(self, model: Any, data: Any = None, val_data: Any = None) -> History:
        """Trains ``model`` and returns the per-epoch metrics.

        Args:
            model: A ``torch.nn.Module`` (loss from ``trainer.loss`` or its
                ``training_step``) or a compiled Keras model.
            data: A torch Dataset, a DataLoader, an ``(x, y)`` pair of arrays, or a
                zero-argument callable returning one; each rank trains on its shard.
                None: built from the config's ``data`` section.
            val_data: Same forms, optional; metrics get a ``val_`` prefix.

        Returns:
            The :class:`History`; in a local cluster the trained weights are also
            loaded into ``model``.

        Raises:
            KeyboardInterrupt: Interrupted; every child process has been stopped.
            Exception: A worker's exception, re-raised with its traceback attached.
        """
        if data is None:
            from bpstrain.trainer.recipe import ConfigData

            if self.config.data.name is None:
                raise ValueError("fit(model) without data needs data.name in the config; "
                                 "otherwise pass data. Received: data=None, data.name=None")
            data = ConfigData(OmegaConf.to_container(self.config), "train")
            val_data = val_data if val_data is not None else ConfigData(
                OmegaConf.to_container(self.config), "val")
        mode = launch_mode(self.config)
        if mode == "local_cluster":
            from bpstrain.trainer._local_cluster import LocalClusterLauncher

            return LocalClusterLauncher(self).launch(model, data, val_data)
        from bpstrain.trainer.callbacks.progress import TqdmSink

        return self.fit_rank(model, data, val_data, TqdmSink(), joined=mode == "rank")

    def fit_rank(self, model: Any, data: Any, val_data: Any, sink: Any, joined: bool) -> History:
        """Runs ``fit`` as one rank of whatever job the environment describes.

        Args:
            sink: Where rank 0's progress bar draws (ignored on other ranks).
            joined: Inside a job launched by someone else: leave the engine running.
        """
        from bpstrain.trainer._comm import Comm

        self._reset()
        self.comm = Comm(comm_options(self.config))
        self.rank, self.size, self.local_rank = self.comm.rank, self.comm.size, self.comm.local_rank
        self.progress_sink = sink if self.is_global_zero else None
        try:
            if is_keras_model(model):
                from bpstrain.trainer._keras import fit_keras

                return fit_keras(self, model, data, val_data)
            from bpstrain.trainer._loop import fit_torch

            return fit_torch(self, model, data, val_data)
        except BaseException as exc:
            fire(self.callbacks, "exception", self, model, exception=exc)
            raise
        finally:
            self.comm.close(leave_engine=joined)

    def checkpoint_state(self) -> Dict[str, Any]:
        """Everything a resume needs, as one picklable dict (torch models)."""
        import torch

        from bpstrain import __version__

        keras = is_keras_model(self.module)
        optimizer = None if keras else self.optimizer
        history = self.history.to_dict()
        epochs = history["epochs"]
        if self.logs and (not epochs or epochs[-1].get("epoch") != self.current_epoch):
            # Saved from on_train_epoch_end: this epoch is not in the history yet.
            history["epochs"].append({"epoch": self.current_epoch, **self.logs})
        state = {
            "epoch": self.current_epoch, "global_step": self.global_step,
            "model": (self.module.get_weights() if keras else self.module.state_dict())
            if self.module is not None else None,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "history": history,
            "config": OmegaConf.to_container(self.config, resolve=True),
            "rng": torch.get_rng_state(), "bpstrain_version": __version__,
        }
        fire(self.callbacks, "save_checkpoint", self, self.module, checkpoint=state)
        return state
