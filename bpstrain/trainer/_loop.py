"""The torch training loop of one rank: epochs, steps, validation, resume.

The loss comes from ``module.training_step(batch, batch_idx)`` when the module has
one (a tensor, or a dict with ``"loss"`` and other scalars to log), else from
``trainer.loss`` applied to ``module(x)`` and ``y`` of an ``(x, y)`` batch.
Validation uses ``validation_step`` the same way (metrics get a ``val_`` prefix),
testing ``test_step`` (``test_`` prefix). Precision, loss scaling and clipping:
:mod:`bpstrain.trainer._precision`; schedulers from ``configure_optimizers``:
:mod:`bpstrain.trainer._optim`.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, Optional

import torch

from bpstrain.config import ConfigError
from bpstrain.trainer import _compression_state, _data, _elastic, _optim, _preempt, _resume
from bpstrain.trainer._dispatch import fire, module_hook
from bpstrain.trainer._precision import Precision, optimizer_step
from bpstrain.trainer.history import History

Sums = Dict[str, list]


def pick_device(name: str, local_rank: int) -> torch.device:
    """``trainer.device`` -> a torch device; one GPU per local rank."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        check_device(name)
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def check_device(name: str) -> None:
    """Raises ConfigError for ``trainer.device=cuda`` on a machine without CUDA."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("Config key 'trainer.device' is 'cuda' but torch sees no CUDA device "
                          f"(torch {torch.__version__}); use trainer.device=auto or cpu. "
                          "Received: trainer.device='cuda'")


def _add(sums: Sums, key: str, total: float, count: float) -> None:
    entry = sums.setdefault(key, [0.0, 0.0])
    entry[0] += total
    entry[1] += count


def _step_outputs(result: Any, what: str) -> Dict[str, Any]:
    """Normalizes a training_step/validation_step result to ``{"loss": tensor, ...}``."""
    if isinstance(result, torch.Tensor):
        return {"loss": result}
    if isinstance(result, dict) and "loss" in result:
        return dict(result)
    raise TypeError(f"{what} must return a loss tensor or a dict with a 'loss' key. "
                    f"Received: {type(result).__name__}")


class _Steps:
    """Computes outputs of one batch for the module's style (custom or built-in loss)."""

    def __init__(self, module, loss_name: str):
        self.module = module
        self.custom = callable(getattr(module, "training_step", None))
        self.loss_fn = None if self.custom else _optim.build_loss(loss_name)
        self.correct = None if self.custom else _optim.accuracy_fn(loss_name)

    def __call__(self, batch, batch_idx: int, validation: bool, stage: str = "") -> Dict[str, Any]:
        if self.custom:
            names = {"test": ("test_step", "validation_step")}.get(
                stage, ("validation_step",) if validation else ())
            step = next((getattr(self.module, n) for n in names
                         if callable(getattr(self.module, n, None))), self.module.training_step)
            return _step_outputs(step(batch, batch_idx), step.__name__)
        if not (isinstance(batch, (list, tuple)) and len(batch) >= 2):
            raise TypeError("With trainer.loss the batches must be (x, y) pairs; for other "
                            "batches give the module a training_step(batch, batch_idx). "
                            f"Received: batch of type {type(batch).__name__}")
        output = self.module(batch[0])
        outputs = {"loss": self.loss_fn(output, batch[1])}
        if self.correct is not None:
            correct = self.correct(output.detach(), batch[1])
            if not math.isnan(correct):
                outputs["accuracy"] = correct / max(_data.batch_size_of(batch), 1)
        return outputs


def _accumulate(sums: Sums, outputs: Dict[str, Any], n: int, prefix: str = "") -> Dict[str, float]:
    logged = {}
    for key, value in outputs.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = float(value.detach())
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            _add(sums, prefix + key, float(value) * n, n)
            logged[key] = float(value)
    return logged


def _means(sums: Sums) -> Dict[str, float]:
    return {k: (s / n if n else math.nan) for k, (s, n) in sums.items()}


def _restore(trainer, module, optimizers: list, watch=None) -> Optional[dict]:
    """Loads the checkpoint to resume from (:func:`bpstrain.trainer._resume.load`) into
    the module, its optimizers, loss scaler and schedulers, and the Trainer's progress.

    Returns:
        The checkpoint loaded (None: starting fresh), for what is restored after the
        optimizers are wrapped (the compressors' error-feedback state).
    """
    loaded = _resume.load(trainer, watch)
    if loaded is None:
        return None
    path, ckpt = loaded
    _load_state(trainer, module, optimizers, ckpt, path)
    if trainer.rank == 0 and ckpt.get("rng") is not None:
        torch.set_rng_state(ckpt["rng"])
    _resume.restore_progress(trainer, module, path, ckpt)
    return ckpt


def _load_state(trainer, module, optimizers: list, ckpt: dict, path: str) -> None:
    """The module, its optimizers, loss scaler and schedulers from a checkpoint's state
    (read from ``path``, or sent by a peer to a worker that joined the running job)."""
    hook = module_hook(module, "on_load_checkpoint")
    if hook is not None:  # Lightning calls the module's before it restores the weights
        hook(ckpt)
    module.load_state_dict(ckpt["model"])
    if ckpt.get("optimizer") is not None:
        states = [ckpt["optimizer"]] + list(ckpt.get("other_optimizers") or [])
        if len(states) != len(optimizers):
            raise ValueError(f"The checkpoint {path} holds the state of {len(states)} "
                             f"optimizer(s) but the module has {len(optimizers)}; resume with "
                             f"the same configure_optimizers(). Received: {len(optimizers)}")
        for optimizer, state in zip(optimizers, states):
            optimizer.load_state_dict(state)
    trainer.precision_plugin.load_state_dict(ckpt.get("grad_scaler") or {})
    for spec, state in zip(trainer.lr_schedulers, ckpt.get("lr_schedulers") or []):
        spec.scheduler.load_state_dict(state)
    if ckpt.get("lr_schedulers_pending"):  # saved at epoch end, before its scheduler step
        last = (ckpt.get("history") or {}).get("epochs") or [{}]
        _step_epoch_schedulers(trainer, int(ckpt["epoch"]), last[-1])


def _build_optimizers(trainer, module) -> tuple:
    """``([optimizer, ...], [SchedulerSpec])`` from ``configure_optimizers`` or the config."""
    if getattr(module, "automatic_optimization", True) is False:
        raise ConfigError("The module sets automatic_optimization = False (Lightning's manual "
                          "optimization), which the bpstrain Trainer does not offer: it runs "
                          "backward and steps every optimizer itself. Return several "
                          "optimizers from configure_optimizers() to step them all each step, "
                          "or use lightning.Trainer(strategy=BpstrainStrategy()). "
                          "Received: automatic_optimization=False")
    configure = getattr(module, "configure_optimizers", None)
    if not callable(configure):
        return [_optim.build_optimizer(trainer.config.optimizer, module.parameters(),
                                       trainer.size)], []
    optimizers, specs = _optim.parse_configure_optimizers(configure())
    o = trainer.config.optimizer
    if specs and (o.warmup_epochs > 0 or o.schedule != "constant"):
        raise ConfigError("configure_optimizers() returned LR schedulers and the config sets "
                          "optimizer.warmup_epochs/optimizer.schedule too; both would set the "
                          "learning rate. Keep one. Received: "
                          f"optimizer.warmup_epochs={o.warmup_epochs}, "
                          f"optimizer.schedule={o.schedule!r}")
    return optimizers, specs


def _step_epoch_schedulers(trainer, epoch: int, logs: Dict[str, Any]) -> None:
    for spec in trainer.lr_schedulers:
        if spec.interval == "epoch" and (epoch + 1) % spec.frequency == 0:
            spec.step(logs)


def setup_module(trainer, module) -> torch.device:
    """Seeds this rank, picks its device and moves ``module`` there."""
    cfg, comm = trainer.config, trainer.comm
    device = pick_device(cfg.trainer.device, comm.local_rank)
    if device.type == "cpu" and comm.local_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.local_size))
    torch.manual_seed(int(cfg.trainer.seed) + trainer.rank)  # dropout etc. differ per rank
    module.to(device)
    trainer.precision_plugin = Precision(str(cfg.trainer.precision), device)
    return device


def fit_torch(trainer, module, data: Any, val_data: Any) -> History:
    """Trains ``module`` on this rank's shard of ``data``; returns the history.

    Raises:
        bpstrain.trainer.Preempted: After the checkpoint SIGUSR1 asked for
            (:mod:`bpstrain.trainer._preempt`).
    """
    with _preempt.Watch(trainer, _preempt.mode(trainer.config)) as watch:
        return _fit_torch(trainer, module, data, val_data, watch)


def _fit_torch(trainer, module, data: Any, val_data: Any, watch) -> History:
    cfg, comm = trainer.config, trainer.comm
    device = setup_module(trainer, module)
    precision = trainer.precision_plugin
    elastic = bool(cfg.comm.get("fault_tolerance", False))
    train_dl = _data.train_loader(data, cfg, trainer.rank, trainer.size, elastic=elastic)
    val_dl, val_size = _data.val_loader(val_data, cfg, trainer.rank, trainer.size), trainer.size
    passes = int(cfg.optimizer.backward_passes_per_step)
    _set_epoch_length(trainer, train_dl, passes, 0)
    optimizers, trainer.lr_schedulers = _build_optimizers(trainer, module)
    trainer.module, trainer.optimizers, trainer.optimizer = module, optimizers, optimizers[0]
    # A worker that joined the running job (fault tolerance) takes the others' state
    # where they are (_elastic.join); it has nothing to resume and nobody to broadcast with.
    joining = elastic and comm.admitted_late
    ckpt = None if joining else _restore(trainer, module, optimizers, watch)
    trainer.optimizers = [comm.wrap_optimizer(o, module, passes) for o in optimizers]
    trainer.optimizer = trainer.optimizers[0]
    _compression_state.restore(trainer, ckpt)  # each rank its own residuals
    _optim.rebind_schedulers(trainer.lr_schedulers, optimizers, trainer.optimizers)
    if joining:
        state = _elastic.join(trainer, train_dl.sampler)
        # Into the wrapped optimizers: loading replaces an optimizer's state dict, which the
        # wrapper shares with the optimizer it wraps only until then.
        _load_state(trainer, module, trainer.optimizers, state, "the worker it joined")
        _resume.restore_callbacks(trainer, state)
    else:
        comm.broadcast_state(module, optimizers)
    step_schedulers = [s for s in trainer.lr_schedulers if s.interval == "step"]
    run = _Steps(module, cfg.trainer.loss)
    callbacks = trainer.callbacks

    fire(callbacks, "fit_start", trainer, module, logs={})
    fire(callbacks, "train_start", trainer, module)
    rank_state = trainer.resume_rank_state
    for epoch in range(trainer.current_epoch, trainer.max_epochs):
        start, trainer.resume_batch = trainer.resume_batch, 0
        trainer.current_epoch, trainer.logs = epoch, dict(trainer.resume_logs) if start else {}
        trainer.train_sums = trainer.resume_sums if start else {}
        trainer.val_sums = None
        train_dl.sampler.set_epoch(epoch)
        if elastic and trainer.resume_sampler is not None:  # joined mid-epoch: the others' deal
            train_dl.sampler.load_state_dict(trainer.resume_sampler)
            trainer.resume_sampler = None
            _set_epoch_length(trainer, train_dl, passes, start)
        else:
            if elastic:  # dealt over the workers in the job now
                _set_epoch_length(trainer, train_dl, passes, 0)
            # A mid-epoch resume: the same shuffled order, less the batches already trained.
            train_dl.sampler.skip = start * train_dl.batch_size
        fire(callbacks, "train_epoch_start", trainer, module, epoch=epoch, logs=trainer.logs)
        module.train()
        _zero_grad(trainer.optimizers)
        batches = iter(train_dl)  # draws from the torch RNG (the loader's base seed)
        if rank_state is not None:  # where this rank's RNGs stood after the saved step
            _preempt.set_rng(rank_state)
            rank_state = None
        for batch_idx, batch in enumerate(batches, start):
            if batch_idx >= trainer.num_training_batches:
                break
            batch = _data.to_device(batch, device)
            trainer.last_batch_size = n = _data.batch_size_of(batch)
            skip = fire(callbacks, "train_batch_start", trainer, module, batch=batch,
                        batch_idx=batch_idx, logs={})
            if skip == -1:
                raise ValueError("on_train_batch_start returned -1 (skip the rest of the "
                                 "epoch), which the Trainer does not support: every rank "
                                 "must run the same steps; set trainer.should_stop in a "
                                 "callback to stop after the epoch. Received: -1")
            with precision.autocast():
                outputs = run(batch, batch_idx, validation=False)
            precision.backward(outputs["loss"].float() / passes)
            fire(callbacks, "after_backward", trainer, module)
            if (batch_idx + 1) % passes == 0:
                optimizer_step(trainer, module, precision, fire)
                _zero_grad(trainer.optimizers)
                trainer.global_step += 1
                for spec in step_schedulers:
                    if trainer.global_step % spec.frequency == 0:
                        spec.step(trainer.logs)
            logged = _accumulate(trainer.train_sums, outputs, n)
            trainer.progress_step = epoch * trainer.num_training_batches + batch_idx + 1
            fire(callbacks, "train_batch_end", trainer, module, outputs=logged, batch=batch,
                 batch_idx=batch_idx, logs=dict(logged, batch=batch_idx, size=n))
            if elastic:  # a step boundary: where workers that left are dealt out
                deals = train_dl.sampler.deals
                train_dl.sampler.record_batch(n)
                # Workers waiting to join come in at an optimizer step's end.
                if (batch_idx + 1) % passes == 0 and _elastic.due(trainer):
                    _elastic.admit(trainer, epoch, batch_idx + 1, train_dl.sampler)
                if train_dl.sampler.deals != deals:  # the rest of the epoch, over other workers
                    _set_epoch_length(trainer, train_dl, passes, batch_idx + 1)
            if (batch_idx + 1) % passes == 0 and watch.should_stop():
                _preempt.save_and_stop(trainer, watch, epoch, batch_idx + 1, train_dl.sampler)
        trainer.logs.update(_means(trainer.train_sums))
        every = int(cfg.trainer.val_every)
        if val_dl is not None and trainer.size != val_size:  # workers left: shard over the others
            val_dl, val_size = _data.val_loader(val_data, cfg, trainer.rank, trainer.size), trainer.size
        if val_dl is not None and every and (epoch + 1) % every == 0:
            _validate(trainer, module, val_dl, run, device)
        trainer.logs["lr"] = _lr(trainer.optimizer)  # the rate this epoch trained with
        for i, other in enumerate(trainer.optimizers[1:], 1):
            trainer.logs[f"lr_{i}"] = _lr(other)
        trainer.schedulers_pending = bool(trainer.lr_schedulers)
        fire(callbacks, "train_epoch_end", trainer, module, epoch=epoch, logs=trainer.logs)
        # After the callbacks: plateau schedulers see the averaged metrics.
        _step_epoch_schedulers(trainer, epoch, trainer.logs)
        trainer.schedulers_pending = False
        trainer.history.append({"epoch": epoch, **trainer.logs})
        trainer.epochs_completed += 1
        if trainer.should_stop:
            break
    fire(callbacks, "train_end", trainer, module, logs=trainer.history.last)
    fire(callbacks, "fit_end", trainer, module)
    return trainer.history


def _set_epoch_length(trainer, train_dl, passes: int, done: int) -> None:
    """``trainer.num_training_batches``: the epoch's batches (at most ``trainer.steps``),
    whole optimizer steps of ``passes`` batches; ``done`` batches of it are behind (an
    elastic deal mid-epoch counts what is left from there)."""
    cap = trainer.config.trainer.steps
    left = _data.batches_left(train_dl) if done else len(train_dl)
    steps = min(done + left, cap or done + left)
    trainer.num_training_batches = max(steps - steps % passes, min(steps, passes))


def _zero_grad(optimizers: list) -> None:
    for optimizer in optimizers:
        optimizer.zero_grad()


def _lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


@torch.no_grad()
def _validate(trainer, module, loader, run: _Steps, device) -> None:
    """One validation pass: ``val_*`` metrics into ``trainer.logs`` (averaged over ranks
    by MetricAveraging at ``on_validation_epoch_end``)."""
    callbacks = trainer.callbacks
    limit = trainer.config.trainer.val_steps
    trainer.num_val_batches = len(loader) if limit is None else min(len(loader), int(limit))
    module.eval()
    trainer.val_sums = {}
    # Every rank reports the same keys even with an empty shard (the sums are reduced).
    for key in ("loss",) + (("accuracy",) if run.correct is not None else ()):
        trainer.val_sums["val_" + key] = [0.0, 0.0]
    fire(callbacks, "validation_start", trainer, module, logs=trainer.logs)
    fire(callbacks, "validation_epoch_start", trainer, module)
    for batch_idx, batch in enumerate(loader):
        if limit is not None and batch_idx >= limit:
            break
        batch = _data.to_device(batch, device)
        with trainer.precision_plugin.autocast():
            outputs = run(batch, batch_idx, validation=True)
        logged = _accumulate(trainer.val_sums, outputs, _data.batch_size_of(batch), "val_")
        fire(callbacks, "validation_batch_end", trainer, module, outputs=logged, batch=batch,
             batch_idx=batch_idx)
    trainer.logs.update(_means(trainer.val_sums))
    fire(callbacks, "validation_epoch_end", trainer, module)
    fire(callbacks, "validation_end", trainer, module, logs=trainer.logs)
    module.train()
