"""Learning-rate warm-up, then a constant, cosine or step schedule (per batch)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

from bpstrain.trainer.callbacks.base import Callback

SCHEDULES = ("constant", "cosine", "step")


def lr_factor(t: float, total_epochs: float, warmup_epochs: float = 0.0,
              schedule: str = "constant", step_epochs: Sequence[int] = (), gamma: float = 0.1,
              warmup_start: float = 0.0) -> float:
    """Multiplier of the base learning rate at fractional epoch ``t`` (0-based).

    Warm-up rises linearly from ``warmup_start`` to 1 over ``warmup_epochs``; after
    it, ``cosine`` decays to 0 at ``total_epochs`` and ``step`` multiplies by ``gamma``
    at each epoch in ``step_epochs``.

    Example:
        >>> lr_factor(0.5, 10, warmup_epochs=1)
        0.5
        >>> round(lr_factor(10, 10, schedule="cosine"), 6)
        0.0
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}. "
                         f"Received: schedule={schedule!r}")
    if warmup_epochs > 0 and t < warmup_epochs:
        return warmup_start + (1.0 - warmup_start) * t / warmup_epochs
    if schedule == "cosine":
        span = max(total_epochs - warmup_epochs, 1e-12)
        progress = min(max((t - warmup_epochs) / span, 0.0), 1.0)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "step":
        return gamma ** sum(1 for e in step_epochs if t >= e)
    return 1.0


def get_lrs(optimizer) -> List[float]:
    """Learning rate of each param group (torch) or the one rate (Keras)."""
    if hasattr(optimizer, "param_groups"):
        return [float(g["lr"]) for g in optimizer.param_groups]
    from bpstrain.keras.callbacks import get_learning_rate

    return [get_learning_rate(optimizer)]


def set_lrs(optimizer, lrs: Sequence[float]) -> None:
    """Inverse of :func:`get_lrs`."""
    if hasattr(optimizer, "param_groups"):
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        return
    from bpstrain.keras.callbacks import set_learning_rate

    set_learning_rate(optimizer, lrs[0])


def _optimizers(trainer) -> list:
    """Every optimizer of the fit (``configure_optimizers`` may return several)."""
    return list(getattr(trainer, "optimizers", None) or [trainer.optimizer])


class LearningRateSchedule(Callback):
    """Sets every param group's lr (of every optimizer) before each training batch.

    With ``scale_lr`` (Horovod's lr * workers), warm-up starts from the unscaled lr
    (factor 1/size), as in Goyal et al.; otherwise it starts near 0.

    Args:
        warmup_epochs: Length of the linear warm-up (fractional epochs allowed).
        schedule: ``"constant"``, ``"cosine"`` or ``"step"`` after warm-up.
        step_epochs: Epochs at which ``step`` decays.
        gamma: Decay factor of ``step``.
        scale_lr: Whether the optimizer's lr was scaled by the number of workers.
    """

    def __init__(self, warmup_epochs: float = 0.0, schedule: str = "constant",
                 step_epochs: Sequence[int] = (), gamma: float = 0.1, scale_lr: bool = False):
        lr_factor(0.0, 1.0, schedule=schedule)  # validates the name now, not mid-fit
        self.warmup_epochs, self.schedule = float(warmup_epochs), schedule
        self.step_epochs, self.gamma, self.scale_lr = list(step_epochs), float(gamma), scale_lr
        self.base_lrs: Optional[List[float]] = None

    @classmethod
    def from_config(cls, opt_cfg: Any) -> "LearningRateSchedule":
        """Built from the ``optimizer`` config section."""
        return cls(opt_cfg.warmup_epochs, opt_cfg.schedule, list(opt_cfg.step_epochs),
                   opt_cfg.gamma, bool(opt_cfg.scale_lr))

    @property
    def is_noop(self) -> bool:
        """True when the lr never changes."""
        return self.warmup_epochs <= 0 and self.schedule == "constant"

    def on_fit_start(self, trainer, module) -> None:
        if self.base_lrs is None or not trainer.resumed:  # a resume keeps the saved ones
            self.base_lrs = [lr for o in _optimizers(trainer) for lr in get_lrs(o)]

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.is_noop:
            return
        t = trainer.current_epoch + (batch_idx + 1) / max(trainer.num_training_batches, 1)
        start = 1.0 / trainer.size if self.scale_lr and trainer.size > 1 else 0.0
        factor = lr_factor(t, trainer.max_epochs, self.warmup_epochs, self.schedule,
                           self.step_epochs, self.gamma, start)
        lrs = [base * factor for base in self.base_lrs]
        optimizers = _optimizers(trainer)
        for optimizer in optimizers:
            count = len(optimizer.param_groups) if len(optimizers) > 1 else len(lrs)
            set_lrs(optimizer, lrs[:count])
            lrs = lrs[count:]

    def on_train_epoch_end(self, trainer, module) -> None:
        trainer.logs.setdefault("lr", get_lrs(trainer.optimizer)[0])

    def state_dict(self) -> Dict[str, Any]:
        return {"base_lrs": self.base_lrs}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.base_lrs = state.get("base_lrs")
