"""The communication timeline is valid Chrome-trace JSON and restores the engine."""

import json

import numpy as np
import pytest

from bpstrain import engine
from bpstrain.trainer import CommTimeline, Trainer
from bpstrain.trainer.callbacks.timeline import EngineRecorder, merge_traces
from tests.trainer.helpers import base_config, blobs, tiny_net


def _check_trace(trace):
    assert set(trace) >= {"traceEvents"}
    for event in trace["traceEvents"]:
        assert event["ph"] in ("X", "M") and isinstance(event["pid"], int)
        assert isinstance(event["tid"], int) and isinstance(event["name"], str)
        if event["ph"] == "X":
            assert event["ts"] > 0 and event["dur"] >= 0


@pytest.mark.timeout(30)
def test_recorder_wraps_engine_calls_and_puts_them_back(tmp_path):
    originals = (engine.submit, engine.poll, engine.synchronize)
    engine.init()
    try:
        recorder = EngineRecorder(rank=0)
        recorder.install()
        engine.push_pull(np.ones(16, np.float32), name="grad.w")
        handle = engine.push_pull_async(np.ones(4, np.float64), name="grad.b")
        assert engine.poll(handle)
        engine.synchronize(handle)
        engine.broadcast(np.zeros(3, np.int32), root_rank=0, name="params")
        recorder.span("step 0", 1.0, 2.0)
        recorder.uninstall()
        assert (engine.submit, engine.poll, engine.synchronize) == originals
    finally:
        engine.shutdown()
    trace = json.loads(json.dumps(recorder.trace()))
    _check_trace(trace)
    ops = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] != 0}
    assert set(ops) == {"push_pull grad.w", "push_pull grad.b", "broadcast params"}
    assert ops["push_pull grad.w"]["args"]["bytes"] == 64
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"steps", "grad.w", "grad.b", "params"}
    out = merge_traces([], tmp_path / "empty.json")
    assert json.loads(out.read_text())["traceEvents"] == []


@pytest.mark.timeout(60)
def test_fit_writes_a_trace_in_process(tmp_path):
    x, y = blobs(64)
    Trainer(base_config(tmp_path), callbacks=[CommTimeline(tmp_path / "t" / "trace.json")]).fit(
        tiny_net(), (x, y))
    trace = json.loads((tmp_path / "t" / "trace.json").read_text())
    _check_trace(trace)
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"]
    assert [e["name"] for e in steps] == [f"step {i}" for i in range(1, 5)]
    assert (tmp_path / "t" / "trace.rank0.json").is_file()
