"""TensorBoard event files of a fit (rank 0): ``trainer.loggers=[csv,tensorboard]``.

Writes into the run folder, so ``tensorboard --logdir <out_dir>`` shows every run
(``version_0``, ``version_1``, ...) side by side. Needs the ``tensorboard`` package
(``pip install "bpstrain[tensorboard]"``).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import types
from pathlib import Path
from typing import Any, Optional, Union

from bpstrain.errors import ConfigError
from bpstrain.trainer.callbacks.base import Callback


def check_tensorboard() -> None:
    """Raises ConfigError when the tensorboard package is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("trainer.loggers includes 'tensorboard' but the tensorboard package "
                          "is not installed; run `pip install \"bpstrain[tensorboard]\"` (or "
                          "`pip install tensorboard`), or drop it from trainer.loggers. "
                          "Received: trainer.loggers contains 'tensorboard'")


def _summary_writer(log_dir: str):
    """``torch.utils.tensorboard.SummaryWriter`` without importing TensorFlow.

    tensorboard reads files through TensorFlow when it is importable (seconds of
    import time and a screenful of TF logs in every worker); its ``notf`` marker
    module selects its own TF-free file layer, which is all a writer needs.
    """
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType(
            "tensorboard.compat.notf"))
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=log_dir)


def _scalar(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(float(value)) else float(value)


class TensorBoardLogger(Callback):
    """Logs the epoch metrics, and the training loss every ``log_every`` steps.

    Scalars: ``train/<metric>`` for training metrics, ``val/<metric>`` for ``val_*``
    ones (both at the global step that ends the epoch), ``train/loss_step`` every
    ``trainer.log_every`` optimizer steps, ``lr`` and ``epoch``.

    Args:
        log_dir: Where the event files go; default the run folder.
    """

    def __init__(self, log_dir: Optional[Union[str, os.PathLike]] = None):
        check_tensorboard()
        self.given_dir = Path(log_dir) if log_dir is not None else None
        self.log_dir: Optional[Path] = self.given_dir
        self.writer = None

    def on_fit_start(self, trainer, module) -> None:
        if not trainer.is_global_zero:
            return
        self.log_dir = self.given_dir or Path(trainer.run_dir)
        self.writer = _summary_writer(str(self.log_dir))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        every = int(trainer.config.trainer.log_every)
        if self.writer is None or not isinstance(outputs, dict) or trainer.global_step % every:
            return
        value = _scalar(outputs.get("loss"))
        if value is not None:
            self.writer.add_scalar("train/loss_step", value, trainer.global_step)

    def on_train_epoch_end(self, trainer, module) -> None:
        if self.writer is None:
            return
        step = trainer.global_step
        for key, value in trainer.logs.items():
            value = _scalar(value)
            if value is None or key == "epoch":
                continue
            if key.startswith("val_"):
                tag = "val/" + key[4:]
            elif key in ("lr", "samples_per_s", "epoch_time"):
                tag = key
            else:
                tag = "train/" + key
            self.writer.add_scalar(tag, value, step)
        self.writer.add_scalar("epoch", trainer.current_epoch, step)
        self.writer.flush()

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def on_fit_end(self, trainer, module) -> None:
        self._close()

    def on_exception(self, trainer, module, exception) -> None:
        self._close()

    def __getstate__(self):  # a writer holds threads and files: never pickled to workers
        state = dict(self.__dict__)
        state["writer"] = None
        return state
