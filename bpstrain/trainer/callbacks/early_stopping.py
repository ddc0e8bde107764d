"""Stop training when a monitored metric stops improving."""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Optional

from bpstrain.trainer.callbacks.base import Callback
from bpstrain.trainer.callbacks.checkpoint import monitor_mode


class EarlyStopping(Callback):
    """Sets ``trainer.should_stop`` after ``patience`` epochs without improvement.

    Metrics are averaged over ranks before this runs, so every rank takes the same
    decision and the job stops in step.

    Args:
        monitor: A key of the epoch logs, e.g. ``"val_loss"`` or ``"val_accuracy"``.
        patience: Epochs without improvement before stopping (>= 1).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (max for accuracy-like names).
        min_delta: Smallest change that counts as an improvement.
    """

    _monitors_metric = True  # after the module's on_train_epoch_end (Lightning's order)

    def __init__(self, monitor: str = "val_loss", patience: int = 3, mode: str = "auto",
                 min_delta: float = 0.0):
        if patience < 1:
            raise ValueError(f"patience must be >= 1. Received: patience={patience}")
        mode = monitor_mode(monitor, mode)
        self.monitor, self.patience, self.mode = monitor, patience, mode
        self.min_delta = abs(min_delta)
        self.best: Optional[float] = None
        self.wait = 0
        self.stopped_epoch: Optional[int] = None
        self._warned = False

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_fit_start(self, trainer, module) -> None:
        if not trainer.resumed:  # a new fit starts from scratch; a resumed one continues
            self.best, self.wait, self.stopped_epoch = None, 0, None

    def on_train_epoch_end(self, trainer, module) -> None:
        value = trainer.logs.get(self.monitor)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            if not self._warned and trainer.is_global_zero:
                warnings.warn(f"EarlyStopping: metric {self.monitor!r} is not in the epoch logs "
                              f"(available: {', '.join(trainer.logs)}); this epoch is skipped. "
                              f"Received: monitor={self.monitor!r}", stacklevel=2)
                self._warned = True
            return
        if self._improved(float(value)):
            self.best, self.wait = float(value), 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = trainer.current_epoch
            trainer.should_stop = True
            trainer.print(f"early stopping at epoch {trainer.current_epoch + 1}: {self.monitor} "
                          f"did not improve for {self.patience} epochs (best {self.best:.4g})")

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best, self.wait = state.get("best"), int(state.get("wait", 0))
        self.stopped_epoch = state.get("stopped_epoch")
