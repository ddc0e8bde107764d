"""A trace of one training step of the training benchmark: where a worker waits.

The worker records one step with the Trainer's :class:`EngineRecorder` (every engine
operation from the moment it is handed to the engine until the caller sees it finished,
and the engine's push and pull phase of each), adds the step's phases (forward,
backward, gradient wait, update) and writes a Chrome trace. :func:`summary` turns such
a trace into one line that says where the step's time went::

    rank 0: backward ends 140.2 ms; engine gets 1st/last op at 12.0/180.3 ms; pushes 12.5-610.1 ms
    (528.0 MB, 0.88 GB/s while pushing); last result 640.2 ms, seen 650.0 ms; wait ends 651.0 ms

All times are from the start of backward. "seen" is when the adapter noticed the last
result (for CUDA tensors: the staging thread that copies it back), so "seen" minus
"last result" is the adapter's own lag, and "engine gets 1st op" minus 0 is how long
gradients took to reach the engine (hooks, fusion, CUDA staging).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

def _now_us() -> float:
    return time.time_ns() / 1000.0  # the recorder's clock


PHASES = ("forward", "backward", "gradient wait", "update")


class StepTracer:
    """Records the engine's work during one step (install/stop around it)."""

    def __init__(self, rank: int):
        from bpstrain.trainer.callbacks.timeline import EngineRecorder

        self.recorder = EngineRecorder(rank)
        self._stager_submit = None

    def start(self) -> None:
        """Begins recording (call right before the traced step)."""
        self.recorder.install()
        self._wrap_stager()

    def _wrap_stager(self) -> None:
        # CUDA tensors reach the engine only after their copy to host: an instant event
        # per tensor when the adapter hands it to the staging threads shows that delay.
        import sys

        cuda = sys.modules.get("bpstrain.torch._cuda")
        if cuda is None:
            self._stager_submit = None
            return
        stager, original = cuda.Stager, cuda.Stager.submit
        self._stager_submit = (stager, original)
        recorder = self.recorder

        def submit(this, tensor, output, name, *args, **kwargs):
            with recorder._lock:
                recorder.events.append({"name": f"staged {name}", "cat": "staged", "ph": "i",
                                        "s": "t", "ts": _now_us(), "pid": recorder.rank,
                                        "tid": 0, "args": {"bytes": tensor.numel() * tensor.element_size()}})
            return original(this, tensor, output, name, *args, **kwargs)

        stager.submit = submit

    def stop(self, phase_bounds_s: Sequence[float], wall_offset_us: float) -> None:
        """Ends recording; ``phase_bounds_s`` are the step's five perf_counter marks
        (start, end of forward, backward, gradient wait, update), ``wall_offset_us``
        turns perf_counter seconds into the recorder's wall-clock microseconds."""
        self.recorder.uninstall()
        if self._stager_submit is not None:
            stager, original = self._stager_submit
            stager.submit = original
        marks = [wall_offset_us + t * 1e6 for t in phase_bounds_s]
        for name, begin, end in zip(PHASES, marks, marks[1:]):
            self.recorder.span(name, begin, end, cat="phase")

    def write(self, path: str) -> Dict[str, Any]:
        """Writes the Chrome trace to ``path``; returns it."""
        trace = self.recorder.trace()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(trace))
        return trace


def _spans(events: List[dict], cat: str) -> List[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == cat]


def summary(trace: Dict[str, Any]) -> Optional[str]:
    """One line per the module docstring, or None when the trace has no step phases."""
    events = trace["traceEvents"]
    phases = {e["name"]: e for e in _spans(events, "phase")}
    if "backward" not in phases:
        return None
    t0 = phases["backward"]["ts"]

    def ms(us: float) -> float:
        return (us - t0) / 1000.0

    ops = _spans(events, "push_pull") + _spans(events, "broadcast")
    staged = sorted(e["ts"] for e in events if e.get("cat") == "staged")
    pushes, pulls = _spans(events, "push"), _spans(events, "pull")
    rank = phases["backward"]["pid"]
    wait = phases.get("gradient wait")
    wait_end = ms(wait["ts"] + wait["dur"]) if wait else float("nan")
    text = f"rank {rank}: backward ends {ms(t0 + phases['backward']['dur']):.1f} ms"
    if staged:
        text += f"; staged 1st/last at {ms(staged[0]):.1f}/{ms(staged[-1]):.1f} ms"
    if ops:
        starts = sorted(e["ts"] for e in ops)
        text += f"; engine gets 1st/last op at {ms(starts[0]):.1f}/{ms(starts[-1]):.1f} ms ({len(ops)} ops)"
    if pushes:
        first = min(e["ts"] for e in pushes)
        last = max(e["ts"] + e["dur"] for e in pushes)
        nbytes = sum(e["args"]["bytes"] for e in pushes)
        rate = nbytes / max(last - first, 1.0) / 1e3  # bytes/us -> GB/s
        text += (f"; pushes {ms(first):.1f}-{ms(last):.1f} ms ({nbytes / 1e6:.1f} MB, "
                 f"{rate:.2f} GB/s while pushing)")
    if pulls:
        text += f"; last result {ms(max(e['ts'] + e['dur'] for e in pulls)):.1f} ms"
    if ops:
        text += f", seen {ms(max(e['ts'] + e['dur'] for e in ops)):.1f} ms"
    return text + f"; wait ends {wait_end:.1f} ms"
