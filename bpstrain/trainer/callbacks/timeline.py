"""Communication timeline: every push_pull/broadcast per tensor, as Chrome-trace JSON.

While fitting, the engine's ``submit`` / ``poll`` / ``synchronize`` are wrapped (in
this process only; every operation of every adapter goes through ``submit``, the
engine's own ``enqueue`` included), so every operation is recorded from the
moment it is queued until the worker sees it complete; the engine itself records the
push phase (first to last partition sent) and the pull phase (first to last reduced
partition received) of each tensor, which appear as ``push <name>`` / ``pull <name>``. Each rank writes
``<dir>/timeline.rank<R>.json``; rank 0 then merges the files it can see into one
trace (one process row per worker, one thread row per tensor, plus a row of
training steps). Open it in chrome://tracing or https://ui.perfetto.dev.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from bpstrain import engine
from bpstrain.trainer.callbacks.base import Callback

_WRAPPED = ("submit", "poll", "synchronize")


def _now_us() -> float:
    return time.time_ns() / 1000.0  # wall clock: traces of processes on a host line up


class EngineRecorder:
    """Records begin/end of engine operations by wrapping the engine facade's calls.

    Args:
        rank: The trace's process id.
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.events: List[Dict[str, Any]] = []
        self._pending: Dict[int, tuple] = {}
        self._tids: Dict[str, int] = {}
        self._lock = threading.Lock()
        self._saved: Optional[Dict[str, Any]] = None

    def install(self) -> None:
        """Replaces the engine functions with recording wrappers (idempotent)."""
        if self._saved is not None:
            return
        self._saved = {name: getattr(engine, name) for name in _WRAPPED}
        engine.submit, engine.poll, engine.synchronize = self._submit, self._poll, self._sync
        if engine.is_initialized():
            engine.set_trace(True)  # the engine adds push and pull phases per tensor

    def uninstall(self) -> None:
        """Puts the original engine functions back."""
        if self._saved is None:
            return
        for name, fn in self._saved.items():
            setattr(engine, name, fn)
        self._saved = None
        if engine.is_initialized():
            self._collect_phases()
            engine.set_trace(False)

    def _collect_phases(self) -> None:
        """Adds the engine's push and pull spans of every finished operation."""
        for rec in engine.drain_trace():
            tid = self._tid(rec["name"])
            for phase, begin, end in (("push", rec["push_begin_us"], rec["push_end_us"]),
                                      ("pull", rec["pull_begin_us"], rec["done_us"])):
                if begin and end:
                    with self._lock:
                        self.events.append({
                            "name": f"{phase} {rec['name']}", "cat": phase, "ph": "X",
                            "ts": float(begin), "dur": float(max(end - begin, 0)),
                            "pid": self.rank, "tid": tid,
                            "args": {"tensor": rec["name"], "bytes": rec["bytes"],
                                     "round": rec["version"]}})

    def _tid(self, name: str) -> int:
        if name not in self._tids:
            self._tids[name] = len(self._tids) + 1  # tid 0 is the steps row
        return self._tids[name]

    def _submit(self, name, dtype, shape, src, dst, op, root=0, priority=0, *args, **kwargs):
        begin = _now_us()
        handle = self._saved["submit"](name, dtype, shape, src, dst, op, root, priority, *args,
                                       **kwargs)
        kind = "broadcast" if op == engine.Op.BROADCAST else "push_pull"
        nbytes = int(getattr(src, "nbytes", 0))
        with self._lock:
            self._pending[handle] = (name, kind, begin, nbytes, priority)
        return handle

    def _finish(self, handle: int) -> None:
        end = _now_us()
        with self._lock:
            item = self._pending.pop(handle, None)
            if item is None:
                return
            label, op, begin, nbytes, priority = item
            self.events.append({
                "name": f"{op} {label}", "cat": op, "ph": "X", "ts": begin,
                "dur": max(end - begin, 0.0), "pid": self.rank, "tid": self._tid(label),
                "args": {"tensor": label, "bytes": nbytes, "priority": priority}})

    def _poll(self, handle):
        done = self._saved["poll"](handle)
        if done:
            self._finish(handle)
        return done

    def _sync(self, handle, timeout=None):
        result = self._saved["synchronize"](handle, timeout)
        self._finish(handle)
        return result

    def span(self, name: str, begin_us: float, end_us: float, cat: str = "step") -> None:
        """Adds a non-communication interval (e.g. one training step) to row 0."""
        with self._lock:
            self.events.append({"name": name, "cat": cat, "ph": "X", "ts": begin_us,
                                "dur": max(end_us - begin_us, 0.0), "pid": self.rank, "tid": 0})

    def trace(self) -> Dict[str, Any]:
        """This rank's Chrome trace (JSON object format)."""
        if engine.is_initialized():
            self._collect_phases()
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                 "args": {"name": f"worker {self.rank}"}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0,
                 "args": {"name": "steps"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                  "args": {"name": name}} for name, tid in self._tids.items()]
        return {"traceEvents": meta + list(self.events), "displayTimeUnit": "ms"}


def merge_traces(paths: List[Union[str, os.PathLike]], out: Union[str, os.PathLike]) -> Path:
    """Concatenates per-rank Chrome traces into one file ``out``."""
    events: List[Dict[str, Any]] = []
    for path in paths:
        events += json.loads(Path(path).read_text())["traceEvents"]
    out = Path(out)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out


class CommTimeline(Callback):
    """Writes the communication timeline of the fit as Chrome-trace JSON.

    Args:
        path: The merged trace; default ``<run folder>/timeline.json``. Per-rank
            files ``timeline.rank<R>.json`` are written next to it.
    """

    def __init__(self, path: Optional[Union[str, os.PathLike]] = None):
        self.given_path = Path(path) if path is not None else None
        self.path = self.given_path
        self.recorder: Optional[EngineRecorder] = None
        self._step_begin = 0.0

    def on_fit_start(self, trainer, module) -> None:
        self.path = self.given_path or Path(trainer.run_dir) / "timeline.json"
        self.recorder = EngineRecorder(trainer.rank)
        self.recorder.install()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._step_begin = _now_us()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.recorder is not None:
            self.recorder.span(f"step {trainer.global_step}", self._step_begin, _now_us())

    def rank_path(self, rank: int) -> Path:
        """Where rank ``rank`` writes its own trace."""
        return self.path.with_name(f"{self.path.stem}.rank{rank}.json")

    def on_fit_end(self, trainer, module) -> None:
        if self.recorder is None:
            return
        self.recorder.uninstall()
        mine = self.rank_path(trainer.rank)
        mine.parent.mkdir(parents=True, exist_ok=True)
        mine.write_text(json.dumps(self.recorder.trace()))
        trainer.comm.barrier()  # every rank's file is written before rank 0 merges
        if trainer.is_global_zero:
            found = [self.rank_path(r) for r in range(trainer.size) if self.rank_path(r).is_file()]
            merge_traces(found, self.path)

    def on_exception(self, trainer, module, exception) -> None:
        if self.recorder is not None:
            self.recorder.uninstall()
