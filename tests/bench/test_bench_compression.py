"""One quick end-to-end run of ``python -m bpstrain.bench compression`` on loopback (tiny
sizes; not a performance test), and its error-line and table helpers."""

from __future__ import annotations

import json

import pytest

from bpstrain.bench import compression
from bpstrain.bench.cli import main

try:
    import bpstrain._core  # noqa: F401
    from bpstrain.torch import Compression
    _READY = hasattr(Compression, "onebit")
    _WHY = "" if _READY else "the torch compressors (Compression.onebit, ...) have not landed"
except ImportError as exc:  # the C++ engine is not built
    _READY, _WHY = False, f"bpstrain engine not importable: {exc}"


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _READY, reason=_WHY)
def test_loopback_smoke_prints_every_part(capsys, tmp_path):
    out_json = tmp_path / "rows.json"
    assert main(["compression", "--loopback", "--hosts", "2", "--servers", "1",
                 "--model", "digits_mlp", "--iters", "1", "--warmup", "1",
                 "--systems", "onebit", "ddp-fp16", "--acc-systems", "topk",
                 "--tta-systems", "none", "--acc-steps", "2", "--acc-seeds", "2", "--tta-steps", "2",
                 "--eval-every", "1", "--tta-hidden", "64", "--tta-target", "0.0",
                 "--kernel-mbytes", "0.25", "--kernel-repeat", "1", "--timeout", "90",
                 "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for heading in ("Step time and bytes on the wire", "Accuracy at equal steps",
                    "Time to 0% test accuracy", "Codec throughput"):
        assert heading in out, out
    rows = json.loads(out_json.read_text())
    wire = {r["system"]: r for r in rows if r["part"] == "wire"}
    assert set(wire) == {"onebit", "ddp-fp16"}
    for row in wire.values():
        assert row["outcome"] == "ok" and row["step_s"] > 0 and row["wire_bytes_per_step"] > 0
    # onebit sends 1 bit per element each way; fp16 16 bits: far fewer bytes on lo
    assert wire["onebit"]["wire_bytes_per_step"] < wire["ddp-fp16"]["wire_bytes_per_step"]
    acc = [r for r in rows if r["part"] == "accuracy"]
    assert [(r["system"], r["steps"], r["target"] is None) for r in acc] == [
        ("topk", 2, True), ("none", 2, False)]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in acc)
    # Two seeds: two runs from other weights and batches, the row their mean.
    seeds = acc[0]["seed_accuracies"]
    assert len(seeds) == 2 and acc[0]["accuracy"] == pytest.approx(sum(seeds) / 2)
    assert len(acc[1]["seed_accuracies"]) == 1  # time to accuracy: one run
    assert acc[1]["steps_to_target"] == 1 and acc[1]["time_to_target_s"] > 0
    kernels = {(r["codec"], r["where"].split(",")[0]) for r in rows if r["part"] == "kernels"}
    assert {("onebit", "torch cpu"), ("powersgd", "torch cpu"), ("topk", "server")} <= kernels
    assert all(r["gb_per_s"] for r in rows if r["part"] == "kernels"), rows


def test_first_error_line_names_the_error():
    crash = ("Benchmark process ddp1 failed. Received: exit code -6\n--- ddp1 stderr ---\n"
             "[W socket.cpp] warning\nterminate called after throwing an instance of "
             "'gloo::EnforceNotMet'\n  what():  [enforce fail at gloo/transport] size mismatch")
    assert compression.first_error_line(crash).startswith("terminate called")
    trace = "Traceback (most recent call last):\n  File x\nAssertionError: in _orthogonalize"
    assert compression.first_error_line(trace) == "AssertionError: in _orthogonalize"
    chained = ("[rank0]: RuntimeError: Got the following error when running the callback: "
               "RuntimeError: [/w/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting")
    assert compression.first_error_line(chained) == (
        "RuntimeError: [unbound_buffer.cc:78] Timed out waiting")
    bare = ('[rank1]:   File "/x/powerSGD_hook.py", line 26, in _orthogonalize\n'
            "[rank1]:     raise AssertionError\n[rank1]: AssertionError")
    assert compression.first_error_line(bare) == (
        "AssertionError in _orthogonalize (powerSGD_hook.py:26)")
    assert compression._outcome(RuntimeError(
        "Benchmark process ddp0 failed.\n" + compression.STEPS_DONE + "\nterminate called")
    ) == "crashed at exit, after its steps: terminate called"


def test_markdown_table_and_specs():
    text = compression.markdown(["system", "s"], [["a", "1.0"], ["bb", "-"]])
    assert text.splitlines()[:2] == ["| system |   s |", "|--------|----:|"]
    plan = compression.CompressionPlan(topk_ratio=0.01, powersgd_rank=2)
    assert plan.spec("topk") == "topk:0.01" and plan.spec("ddp-powersgd") == "powersgd"
    assert plan.spec("ddp") == "none" and plan.label("randomk") == "bpstrain random-k 1%"
    with pytest.raises(ValueError):
        compression.CompressionPlan(systems=["nope"])
