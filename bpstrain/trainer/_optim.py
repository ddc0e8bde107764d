"""Optimizer, loss and accuracy from the config's names (torch)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn


def base_lr(opt_cfg: Any, size: int) -> float:
    """The learning rate after Horovod's ``scale_lr`` convention (lr * workers)."""
    return float(opt_cfg.lr) * (size if opt_cfg.scale_lr else 1)


def build_optimizer(opt_cfg: Any, params, size: int) -> torch.optim.Optimizer:
    """A torch optimizer for ``optimizer.name`` with the config's hyper-parameters.

    Raises:
        ValueError: An optimizer name the schema does not know.
    """
    name, lr, wd = opt_cfg.name, base_lr(opt_cfg, size), float(opt_cfg.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=float(opt_cfg.momentum),
                               weight_decay=wd, nesterov=bool(opt_cfg.nesterov))
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls(params, lr=lr, betas=tuple(opt_cfg.betas), eps=float(opt_cfg.eps),
                   weight_decay=wd)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, momentum=float(opt_cfg.momentum),
                                   eps=float(opt_cfg.eps), weight_decay=wd)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=float(opt_cfg.eps), weight_decay=wd)
    raise ValueError("optimizer.name must be one of sgd, adam, adamw, rmsprop, adagrad. "
                     f"Received: optimizer.name={name!r}")


_LOSSES = {
    "cross_entropy": nn.CrossEntropyLoss,
    "nll": nn.NLLLoss,
    "mse": nn.MSELoss,
    "l1": nn.L1Loss,
    "smooth_l1": nn.SmoothL1Loss,
    "bce_with_logits": nn.BCEWithLogitsLoss,
}
CLASSIFICATION_LOSSES = ("cross_entropy", "nll")


def build_loss(name: str) -> nn.Module:
    """The torch loss module for ``trainer.loss`` (mean reduction)."""
    if name not in _LOSSES:
        raise ValueError(f"trainer.loss must be one of {', '.join(_LOSSES)}. "
                         f"Received: trainer.loss={name!r}")
    return _LOSSES[name]()


def accuracy_fn(loss_name: str) -> Optional[Callable]:
    """``(output, target) -> number correct`` for classification losses, else None."""
    if loss_name in CLASSIFICATION_LOSSES:
        def correct(output: torch.Tensor, target: torch.Tensor) -> float:
            if output.dim() < 2 or target.dim() != output.dim() - 1:
                return float("nan")
            return float((output.argmax(dim=1) == target).sum())
        return correct
    if loss_name == "bce_with_logits":
        def correct_binary(output: torch.Tensor, target: torch.Tensor) -> float:
            if output.shape != target.shape:
                return float("nan")
            return float(((output > 0).to(target.dtype) == target).sum())
        return correct_binary
    return None


# ------------------------------------------------------------- configure_optimizers

_INTERVALS = ("epoch", "step")


class SchedulerSpec:
    """One LR scheduler from ``configure_optimizers`` and when it steps (Lightning's dict).

    Attributes:
        scheduler: The torch LR scheduler.
        interval: ``"epoch"`` (after each epoch's validation) or ``"step"`` (after each
            optimizer step).
        frequency: Step it every this many intervals.
        monitor: Metric passed to ``ReduceLROnPlateau.step`` (default ``val_loss``).
    """

    def __init__(self, scheduler: Any, interval: str = "epoch", frequency: int = 1,
                 monitor: Optional[str] = None):
        if interval not in _INTERVALS:
            raise ValueError("lr_scheduler 'interval' must be 'epoch' or 'step'. "
                             f"Received: interval={interval!r}")
        if int(frequency) < 1:
            raise ValueError(f"lr_scheduler 'frequency' must be >= 1. Received: {frequency}")
        self.scheduler, self.interval, self.frequency = scheduler, interval, int(frequency)
        self.plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self.monitor = monitor or ("val_loss" if self.plateau else None)

    def step(self, logs: dict) -> None:
        """Steps the scheduler (a plateau scheduler with the monitored metric)."""
        if not self.plateau:
            self.scheduler.step()
            return
        if self.monitor not in logs:
            raise KeyError(f"ReduceLROnPlateau monitors {self.monitor!r}, which is not in the "
                           f"epoch logs ({', '.join(logs)}); set 'monitor' in the lr_scheduler "
                           f"dict of configure_optimizers. Received: monitor={self.monitor!r}")
        self.scheduler.step(float(logs[self.monitor]))


def _scheduler_spec(item: Any) -> SchedulerSpec:
    if isinstance(item, SchedulerSpec):
        return item
    if isinstance(item, dict):
        if "scheduler" not in item:
            raise TypeError("An lr_scheduler dict needs a 'scheduler' key (Lightning's "
                            f"format). Received: keys {sorted(item)}")
        unknown = set(item) - {"scheduler", "interval", "frequency", "monitor", "name",
                               "strict"}
        if unknown:
            raise TypeError(f"Unknown lr_scheduler keys {sorted(unknown)}; expected scheduler, "
                            "interval, frequency, monitor. Received: " + str(sorted(item)))
        return SchedulerSpec(item["scheduler"], item.get("interval", "epoch"),
                             item.get("frequency", 1), item.get("monitor"))
    if hasattr(item, "step") and hasattr(item, "optimizer"):
        return SchedulerSpec(item)
    raise TypeError("An lr scheduler must be a torch LR scheduler or a dict with 'scheduler'. "
                    f"Received: {type(item).__name__}")


def _split(item: Any) -> tuple:
    """``(optimizer, [scheduler items])`` of one optimizer entry (maybe Lightning's dict)."""
    if isinstance(item, dict):
        if "optimizer" not in item:
            raise TypeError("configure_optimizers() returned a dict without 'optimizer'. "
                            f"Received: keys {sorted(item)}")
        unknown = set(item) - {"optimizer", "lr_scheduler", "monitor"}
        if unknown:
            raise TypeError(f"Unknown configure_optimizers() dict keys {sorted(unknown)}; "
                            "expected optimizer, lr_scheduler. Received: " + str(sorted(item)))
        sched = item.get("lr_scheduler")
        if isinstance(sched, dict) and "monitor" in item and "monitor" not in sched:
            sched = {**sched, "monitor": item["monitor"]}
        elif sched is not None and not isinstance(sched, dict) and "monitor" in item:
            sched = {"scheduler": sched, "monitor": item["monitor"]}
        return item["optimizer"], [] if sched is None else [sched]
    return item, []


def parse_configure_optimizers(result: Any) -> tuple:
    """``([optimizer, ...], [SchedulerSpec, ...])`` from what ``configure_optimizers()``
    returned.

    Accepted (Lightning's forms): an optimizer; a list or tuple of optimizers;
    ``([optimizers], [schedulers])``; ``{"optimizer": opt, "lr_scheduler": sched or
    {"scheduler": sched, "interval": "step", "frequency": 1, "monitor": "val_loss"}}``;
    a list or tuple of such dicts. Several optimizers must own disjoint parameters:
    each is wrapped in its own DistributedOptimizer, and every training step runs one
    backward pass and then steps each of them (Lightning's automatic optimization
    allows one optimizer; this is its natural extension, e.g. SparseAdam for the
    embeddings and AdamW for the rest).

    Raises:
        TypeError: Another form, no optimizer, a parameter in two optimizers, or a
            scheduler of an optimizer that was not returned.
    """
    schedulers: list = []
    if (isinstance(result, (list, tuple)) and len(result) == 2
            and isinstance(result[0], (list, tuple)) and isinstance(result[1], (list, tuple))):
        entries, schedulers = list(result[0]), list(result[1])
    elif isinstance(result, (list, tuple)):
        entries = list(result)
    else:
        entries = [result]
    optimizers = []
    for entry in entries:
        optimizer, scheds = _split(entry)
        optimizers.append(optimizer)
        schedulers += scheds
    if not optimizers:
        raise TypeError("configure_optimizers() returned no optimizer. Received: "
                        f"{type(result).__name__} of length 0")
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("configure_optimizers() must return torch optimizers, optionally "
                            f"with LR schedulers. Received: {type(optimizer).__name__}")
    owner: dict = {}
    for i, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if owner.setdefault(id(p), i) != i:
                    raise TypeError("A parameter is in two optimizers of configure_optimizers()"
                                    "; each optimizer must own its parameters (its gradients "
                                    "are averaged once). Received: a parameter of shape "
                                    f"{tuple(p.shape)} in optimizers {owner[id(p)]} and {i}")
    specs = [_scheduler_spec(s) for s in schedulers]
    for spec in specs:
        if not any(spec.scheduler.optimizer is o for o in optimizers):
            raise TypeError("Each LR scheduler of configure_optimizers() must drive one of the "
                            "returned optimizers. Received: a scheduler of another optimizer")
    return optimizers, specs


def rebind_schedulers(specs: list, originals: list, wrapped: list) -> None:
    """Points each scheduler at the (distributed) optimizer that replaced its own.

    The wrapper shares the param groups, so learning rates already reach it; this also
    marks its ``step`` the way torch schedulers do, so they do not warn that
    ``optimizer.step()`` was never called.
    """
    for spec in specs:
        index = next((i for i, o in enumerate(originals) if spec.scheduler.optimizer is o),
                     None)
        if index is None or spec.scheduler.optimizer is wrapped[index]:
            continue
        optimizer = wrapped[index]
        spec.scheduler.optimizer = optimizer
        step = optimizer.step
        if not hasattr(step, "_wrapped_by_lr_sched"):
            def tracked(*args, _step=step, _optimizer=optimizer, **kwargs):
                _optimizer._opt_called = True
                return _step(*args, **kwargs)

            tracked._wrapped_by_lr_sched = True
            optimizer.step = tracked
