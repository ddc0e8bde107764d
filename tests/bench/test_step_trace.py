"""The training benchmark's one-line step summary, on a hand-made trace."""

from __future__ import annotations

from bpstrain.bench._step_trace import summary


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 3, "tid": 1,
            "args": args}


def test_summary_measures_from_the_start_of_backward():
    events = [
        _x("phase", "forward", 0, 1000), _x("phase", "backward", 1000, 4000),
        _x("phase", "gradient wait", 5000, 6000), _x("phase", "update", 11000, 500),
        {"ph": "i", "cat": "staged", "name": "staged fc", "ts": 1500, "pid": 3, "tid": 0},
        _x("push_pull", "push_pull fc", 2000, 8000, bytes=2_000_000),
        _x("push_pull", "push_pull conv", 4000, 6500, bytes=1_000_000),
        _x("push", "push fc", 2100, 2000, bytes=2_000_000),
        _x("push", "push conv", 4100, 1900, bytes=1_000_000),
        _x("pull", "pull fc", 4100, 5000, bytes=2_000_000),
        _x("pull", "pull conv", 6000, 3500, bytes=1_000_000),
    ]
    line = summary({"traceEvents": events})
    assert line == ("rank 3: backward ends 4.0 ms; staged 1st/last at 0.5/0.5 ms; engine gets "
                    "1st/last op at 1.0/3.0 ms (2 ops); pushes 1.1-5.0 ms (3.0 MB, 0.77 GB/s "
                    "while pushing); last result 8.5 ms, seen 9.5 ms; wait ends 10.0 ms")


def test_summary_without_phases_is_none():
    assert summary({"traceEvents": [_x("push", "push fc", 0, 1, bytes=1)]}) is None
