"""One quick end-to-end run of the benchmark CLI (tiny sizes; not a performance test)."""

from __future__ import annotations

import os

import pytest

from bpstrain.bench import emulated
from bpstrain.bench.cli import main

try:
    import bpstrain._core  # noqa: F401
    import bpstrain.engine  # noqa: F401
    _ENGINE, _WHY = True, ""
except ImportError as exc:  # the C++ engine is not built
    _ENGINE, _WHY = False, f"bpstrain engine not importable: {exc}"

pytestmark = pytest.mark.skipif(not _ENGINE, reason=_WHY)


@pytest.mark.timeout(180)
def test_loopback_bench_prints_table(capsys):
    assert main(["loopback", "--size", "256K", "--iters", "2", "--warmup", "1",
                 "--latency-iters", "5", "--timeout", "120"]) == 0
    out = capsys.readouterr().out.splitlines()
    systems = [line.split()[0] for line in out[3:]]
    assert sorted(systems) == ["bpstrain", "bpstrain", "bpstrain-flat", "bpstrain-flat", "gloo", "gloo"]


@pytest.mark.timeout(240)
@pytest.mark.skipif(not emulated.available()[0], reason=emulated.available()[1])
def test_cluster_bench_prints_table(capsys):
    assert main(["cluster", "--workers", "2", "--servers", "1", "--sizes", "256K",
                 "--rate-mbit", "400", "--iters", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in out[3:]) == ["bpstrain", "gloo"]
    assert emulated.list_namespaces(f"{emulated.DEFAULT_PREFIX}{os.getpid()}x") == []


def _has_ucx() -> bool:
    from tests.engine.conftest import _ucx_available

    return _ucx_available()


@pytest.mark.timeout(240)
@pytest.mark.skipif(not emulated.available()[0], reason=emulated.available()[1])
def test_cluster_bench_runs_each_transport_on_the_same_hosts(capsys):
    if not _has_ucx():
        pytest.skip("this build or machine has no UCX")
    assert main(["cluster", "--workers", "2", "--servers", "1", "--sizes", "256K",
                 "--rate-mbit", "400", "--iters", "2", "--warmup", "1", "--no-gloo",
                 "--transports", "tcp", "ucx:tcp"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:]]
    assert [r[:2] for r in rows] == [["bpstrain", "2"], ["bpstrain", "ucx:tcp"]]
    assert emulated.list_namespaces(f"{emulated.DEFAULT_PREFIX}{os.getpid()}x") == []


@pytest.mark.timeout(180)
def test_training_bench_traces_the_last_step(tmp_path, capsys):
    """--trace writes one merged Chrome trace per job and logs where each worker waited."""
    import json

    from bpstrain.bench import training

    assert training.main(["--loopback", "--model", "resnet50", "--hosts", "2", "--servers", "1",
                          "--iters", "1", "--warmup", "1", "--systems", "bpstrain",
                          "--trace", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    trace = json.loads((tmp_path / "resnet50-bpstrain.json").read_text())["traceEvents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resnet50-bpstrain.json"]
    for rank in (0, 1):
        phases = {e["name"] for e in trace if e.get("cat") == "phase" and e["pid"] == rank}
        assert phases == {"forward", "backward", "gradient wait", "update"}
        pushed = sum(e["args"]["bytes"] for e in trace if e.get("cat") == "push" and e["pid"] == rank)
        assert pushed > 90e6  # ResNet-50's 25.6M float32 gradients, in fused buckets or alone
        assert f"rank {rank}: backward ends" in err


@pytest.mark.timeout(180)
def test_stragglers_bench_compares_sync_k_of_n_and_ssp(capsys):
    assert main(["stragglers", "--loopback", "--hosts", "3", "--servers", "1", "--steps", "12",
                 "--compute-ms", "10", "--scenarios", "persistent", "--systems", "sync", "k:2",
                 "ssp:1", "--eval-every", "6"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:]]
    assert [r[:2] for r in rows] == [["persistent", "sync"], ["persistent", "k:2"], ["persistent", "ssp:1"]]
    late = {r[1]: int(r[-2]) for r in rows}
    stale = {r[1]: int(r[-1]) for r in rows}
    assert late["sync"] == 0 and late["k:2"] > 0  # the slow worker's pushes did not count
    assert stale["sync"] == 0 and stale["ssp:1"] == 1  # the fast ones ran one step ahead


@pytest.mark.timeout(240)
def test_sparse_bench_runs_the_five_systems(capsys):
    assert main(["sparse", "--loopback", "--hosts", "2", "--servers", "1", "--rows", "20000", "--dim", "8",
                 "--batch", "64", "--fields", "4", "--steps", "2", "--dense-steps", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:]]
    assert [r[0] for r in rows] == ["bpstrain-sparse", "bpstrain-table", "bpstrain-prefetch", "bpstrain-dense", "ddp"]
    for r in rows[:3]:  # the bpstrain sparse rows have their bounds
        assert r[7] != "-" and r[9] != "-", r
    assert all(c.endswith("x") for c in rows[4][-3:])  # the three speed-up columns
