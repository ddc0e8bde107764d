"""One tqdm progress bar for the whole fit, drawn on rank 0 only.

The callback talks to a *sink*: in-process it is a :class:`TqdmSink` (tqdm.auto);
in a worker of a local cluster started from a notebook it is a queue that carries
the same calls to the parent, which owns the only bar.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Dict, Optional

from bpstrain.trainer.callbacks.base import Callback


class TqdmSink:
    """Draws the bar with ``tqdm.auto`` in this process; also prints metric lines."""

    def __init__(self):
        self._bar = None

    def start(self, total: int, initial: int, desc: str) -> None:
        from tqdm.auto import tqdm

        self.close()
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)

    def update(self, step: int, desc: Optional[str] = None,
               postfix: Optional[Dict[str, Any]] = None) -> None:
        if self._bar is None:
            return
        if desc is not None:
            self._bar.set_description(desc, refresh=False)
        if postfix is not None:
            self._bar.set_postfix({k: _short(v) for k, v in postfix.items()}, refresh=False)
        self._bar.update(max(0, step - self._bar.n))

    def write(self, line: str, stderr: bool = False) -> None:
        stream = sys.stderr if stderr else sys.stdout
        if self._bar is not None:
            self._bar.write(line, file=stream)  # keeps the bar intact below the line
        else:
            print(line, file=stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


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
    """A single progress bar over all epochs (rank 0), plus one metrics line per epoch.

    Args:
        refresh_s: Minimum seconds between two bar updates (keeps queues quiet).
        print_metrics: Whether to print each epoch's metrics as a line.
    """

    def __init__(self, refresh_s: float = 0.1, print_metrics: bool = True):
        self.refresh_s = refresh_s
        self.print_metrics = print_metrics
        self._last = 0.0
        self._active = False

    def _desc(self, trainer) -> str:
        return f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"

    def on_train_start(self, trainer, module) -> None:
        self._active = trainer.is_global_zero
        if self._active:
            steps = trainer.num_training_batches
            trainer.progress_sink.start(steps * trainer.max_epochs,
                                        steps * trainer.current_epoch, self._desc(trainer))

    def on_train_epoch_start(self, trainer, module) -> None:
        if self._active:
            trainer.progress_sink.update(trainer.progress_step, desc=self._desc(trainer))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = time.monotonic()
        last_batch = batch_idx + 1 >= trainer.num_training_batches
        if self._active and (now - self._last >= self.refresh_s or last_batch):
            self._last = now
            loss = outputs.get("loss") if isinstance(outputs, dict) else None
            trainer.progress_sink.update(trainer.progress_step,
                                         postfix={"loss": loss} if loss is not None else None)

    def on_train_epoch_end(self, trainer, module) -> None:
        if not self._active:
            return
        shown = {k: v for k, v in trainer.logs.items() if k not in ("epoch", "epoch_time")}
        trainer.progress_sink.update(trainer.progress_step, postfix={
            k: v for k, v in shown.items() if "loss" in k or "acc" in k})
        if self.print_metrics:
            text = "  ".join(f"{k}={_short(v)}" for k, v in shown.items())
            trainer.progress_sink.write(f"{self._desc(trainer)}: {text}")

    def on_train_end(self, trainer, module) -> None:
        if self._active:
            trainer.progress_sink.close()

    def on_exception(self, trainer, module, exception) -> None:
        self.on_train_end(trainer, module)
