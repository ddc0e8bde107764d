"""Progress bars of a fit, drawn on rank 0 only: one per epoch, one per validation pass.

The callback talks to a *sink*: in-process it is a :class:`TqdmSink` (tqdm.auto);
in a worker of a local cluster started from a notebook it is a queue that carries
the same calls to the parent, which owns the only bars.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Dict, Optional

from bpstrain.trainer.callbacks.base import Callback


class TqdmSink:
    """Draws bars with ``tqdm.auto`` in this process; also prints metric lines.

    Bars are named: ``"train"`` (one per epoch, kept on screen) and ``"val"`` (the
    validation pass, removed when it ends); starting a bar replaces the one of the
    same name.
    """

    def __init__(self):
        self._bars: Dict[str, Any] = {}

    def start(self, total: int, initial: int, desc: str, name: str = "train",
              leave: bool = True) -> None:
        from tqdm.auto import tqdm

        self.close(name)
        self._bars[name] = tqdm(total=total, initial=initial, desc=desc, unit="step",
                                dynamic_ncols=True, leave=leave)

    def update(self, step: int, desc: Optional[str] = None,
               postfix: Optional[Dict[str, Any]] = None, name: str = "train") -> None:
        bar = self._bars.get(name)
        if bar is None:
            return
        if desc is not None:
            bar.set_description(desc, refresh=False)
        if postfix is not None:
            bar.set_postfix({k: _short(v) for k, v in postfix.items()}, refresh=False)
        bar.update(max(0, step - bar.n))

    def write(self, line: str, stderr: bool = False) -> None:
        stream = sys.stderr if stderr else sys.stdout
        if self._bars:
            next(iter(self._bars.values())).write(line, file=stream)  # keeps bars intact
        else:
            print(line, file=stream, flush=True)

    def close(self, name: Optional[str] = None) -> None:
        """Closes the bar ``name``, or every bar when None."""
        for key in ([name] if name is not None else list(self._bars)):
            bar = self._bars.pop(key, None)
            if bar is not None:
                bar.close()


class QueueSink:
    """Forwards sink calls as ``("progress", method, args)`` messages on a queue."""

    def __init__(self, queue):
        self._queue = queue

    def __getattr__(self, method: str):
        if method not in ("start", "update", "write", "close"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self._queue.put(("progress", method, args, kwargs))


def _short(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return value


class ProgressBar(Callback):
    """A progress bar per epoch and one for each validation pass (rank 0 only).

    Each epoch's bar stays on screen with its final metrics; the validation bar
    disappears when validation ends. With ``print_metrics`` (``trainer.epoch_summary``)
    a line of the epoch's metrics is printed as well.

    Args:
        refresh_s: Minimum seconds between two bar updates (keeps queues quiet).
        print_metrics: Whether to print each epoch's metrics as a line.
    """

    def __init__(self, refresh_s: float = 0.1, print_metrics: bool = True):
        self.refresh_s = refresh_s
        self.print_metrics = print_metrics
        self._last = 0.0

    @staticmethod
    def _active(trainer) -> bool:
        return trainer.is_global_zero and trainer.progress_sink is not None

    def _desc(self, trainer) -> str:
        return f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"

    def on_train_epoch_start(self, trainer, module) -> None:
        if self._active(trainer):
            trainer.progress_sink.start(trainer.num_training_batches, 0, self._desc(trainer))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = time.monotonic()
        last_batch = batch_idx + 1 >= trainer.num_training_batches
        if self._active(trainer) and (now - self._last >= self.refresh_s or last_batch):
            self._last = now
            loss = outputs.get("loss") if isinstance(outputs, dict) else None
            trainer.progress_sink.update(batch_idx + 1,
                                         postfix={"loss": loss} if loss is not None else None)

    def on_validation_start(self, trainer, module) -> None:
        if self._active(trainer) and trainer.num_val_batches:
            trainer.progress_sink.start(trainer.num_val_batches, 0, "validation", name="val",
                                        leave=False)

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = time.monotonic()
        last_batch = batch_idx + 1 >= trainer.num_val_batches
        if self._active(trainer) and (now - self._last >= self.refresh_s or last_batch):
            self._last = now
            trainer.progress_sink.update(batch_idx + 1, name="val")

    def on_validation_end(self, trainer, module) -> None:
        if self._active(trainer):
            trainer.progress_sink.close("val")

    def on_train_epoch_end(self, trainer, module) -> None:
        if not self._active(trainer):
            return
        shown = {k: v for k, v in trainer.logs.items() if k not in ("epoch", "epoch_time")}
        trainer.progress_sink.update(trainer.num_training_batches, postfix={
            k: v for k, v in shown.items() if "loss" in k or "acc" in k})
        trainer.progress_sink.close("train")
        if self.print_metrics:
            text = "  ".join(f"{k}={_short(v)}" for k, v in shown.items())
            trainer.progress_sink.write(f"{self._desc(trainer)}: {text}")

    def on_train_end(self, trainer, module) -> None:
        if self._active(trainer):
            trainer.progress_sink.close()

    def on_exception(self, trainer, module, exception) -> None:
        self.on_train_end(trainer, module)
