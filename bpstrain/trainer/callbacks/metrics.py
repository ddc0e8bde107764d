"""Metric averaging over ranks and a samples/s meter."""

from __future__ import annotations

import math
import time
from typing import Any, Dict

from bpstrain.trainer.callbacks.base import Callback


class MetricAveraging(Callback):
    """Replaces each rank's epoch metrics with the average over all ranks.

    In the torch loop every rank keeps ``(sum, count)`` per metric, so the result is
    the exact sample-weighted mean (the same on every rank), as if one process had
    seen all the data. Validation metrics are averaged at ``on_validation_epoch_end``,
    training metrics at ``on_train_epoch_end``. With only plain logs (Keras) the
    values are averaged unweighted. Always dispatched before other callbacks.
    """

    _dispatch_first = True

    def on_validation_epoch_end(self, trainer, module) -> None:
        average_sums(trainer, trainer.val_sums, "val")

    def on_train_epoch_end(self, trainer, module) -> None:
        sums = trainer.train_sums
        if sums is None:  # plain logs: unweighted mean of every numeric value
            sums = {k: (float(v), 1.0) for k, v in trainer.logs.items()
                    if isinstance(v, (int, float)) and k != "epoch"}
        average_sums(trainer, sums, "train")


def average_sums(trainer, sums: Dict[str, Any], tag: str) -> None:
    """Sets ``trainer.logs[key]`` to the sample-weighted mean over ranks of each
    ``key: (sum, count)``; every rank must pass the same keys."""
    if not sums:
        return
    flat: Dict[str, float] = {}
    for key, (total, count) in sums.items():
        flat[key + "/sum"], flat[key + "/n"] = float(total), float(count)
    reduced = trainer.comm.sum_metrics(flat, tag)
    for key in sums:
        count = reduced[key + "/n"]
        trainer.logs[key] = reduced[key + "/sum"] / count if count else math.nan


class Throughput(Callback):
    """Measures training samples/s of the whole job (all workers) for every epoch.

    Adds ``samples_per_s`` and ``epoch_time`` (seconds of training, validation
    excluded) to the epoch logs; ``total_samples`` / ``total_time`` accumulate.

    Args:
        verbose: Print a line per epoch on rank 0.
    """

    def __init__(self, verbose: bool = False):
        self.verbose = verbose
        self.total_samples = 0
        self.total_time = 0.0
        self._start = 0.0
        self._stop = None
        self._samples = 0

    @property
    def samples_per_s(self) -> float:
        """Average over every epoch measured so far (0 before the first)."""
        return self.total_samples / self.total_time if self.total_time else 0.0

    def on_fit_start(self, trainer, module) -> None:
        if not trainer.resumed:
            self.total_samples, self.total_time = 0, 0.0

    def on_train_epoch_start(self, trainer, module) -> None:
        self._start, self._stop, self._samples = time.perf_counter(), None, 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._samples += trainer.last_batch_size

    def on_validation_start(self, trainer, module) -> None:
        self._stop = time.perf_counter()

    def on_train_epoch_end(self, trainer, module) -> None:
        elapsed = (self._stop or time.perf_counter()) - self._start
        # Every rank runs equally many equally sized batches (padded shards).
        samples = self._samples * trainer.size
        self.total_samples += samples
        self.total_time += elapsed
        trainer.logs["samples_per_s"] = samples / elapsed if elapsed > 0 else math.nan
        trainer.logs["epoch_time"] = elapsed
        if self.verbose:
            trainer.print(f"epoch {trainer.current_epoch + 1}: {trainer.logs['samples_per_s']:.1f} "
                          f"samples/s ({trainer.size} workers, {elapsed:.2f} s)")

    def state_dict(self) -> Dict[str, Any]:
        return {"total_samples": self.total_samples, "total_time": self.total_time}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.total_samples = int(state.get("total_samples", 0))
        self.total_time = float(state.get("total_time", 0.0))
