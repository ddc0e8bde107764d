"""Hierarchical and scaling benchmarks: plans, tables, CLI, job wiring, one tiny real run each."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bpstrain.bench import _jobs, emulated, hierarchical, scaling
from bpstrain.bench._report import MARKER
from bpstrain.bench.cli import build_parser, main
from bpstrain.bench.hierarchical import HierPlan, attach_flat, make_row
from bpstrain.bench.scaling import ScalingPlan, format_grid
from bpstrain.bench.table import Row

MB = 1 << 20

try:
    import bpstrain._core  # noqa: F401
    _ENGINE, _WHY = True, ""
except ImportError as exc:  # the C++ engine is not built
    _ENGINE, _WHY = False, f"bpstrain engine not importable: {exc}"
_NETNS, _NETNS_WHY = emulated.available()
needs_cluster = pytest.mark.skipif(not (_ENGINE and _NETNS), reason=_WHY or _NETNS_WHY)


def _mine() -> list[str]:
    return emulated.list_namespaces(f"{emulated.DEFAULT_PREFIX}{os.getpid()}x")


# --- hierarchical -----------------------------------------------------------

def test_hier_plan_layout_and_bounds():
    plan = HierPlan(size=64 * MB, rate_mbit=800)
    assert (plan.num_hosts, plan.workers) == (5, 4)
    assert plan.layout() == _jobs.Layout([0, 1], [2, 3], 4, 2)
    # Flat: a host sends 2 x 64M at 100 MB/s; hierarchical: 64M.
    assert plan.bound_s(False) == pytest.approx(2 * 64 * MB / 100e6)
    assert plan.bound_s(True) == pytest.approx(plan.bound_s(False) / 2)
    assert plan.timeout_s() > 120
    for bad in ({"size": 6}, {"local_size": 0}, {"servers": 0}, {"iters": 0}):
        with pytest.raises(ValueError, match="Received"):
            HierPlan(**bad)


def _payloads(pushed_per_rank, times_per_rank, nbytes=4 * MB):
    return [{"rank": r, "size": len(pushed_per_rank),
             "results": [{"bytes": nbytes, "times": times, "bytes_pushed": pushed}]}
            for r, (pushed, times) in enumerate(zip(pushed_per_rank, times_per_rank))]


def test_rows_sum_ranks_per_host_and_table_compares_with_flat():
    plan = HierPlan(size=4 * MB, rate_mbit=800)
    flat = make_row("flat", plan, _payloads([4 * MB] * 4, [[0.2, 0.3]] * 4))
    hier = make_row("hierarchical", plan,
                    _payloads([2 * MB] * 4, [[0.1, 0.1], [0.1, 0.1], [0.1, 0.1], [0.1, 0.2]]))
    rows = [flat, hier]
    attach_flat(rows)
    assert flat.host_pushed == [8 * MB, 8 * MB] and hier.host_pushed == [4 * MB, 4 * MB]
    assert hier.time_s == pytest.approx(0.15)  # median of the slowest rank: 0.1, 0.2
    lines = hierarchical.format_table(rows).splitlines()
    assert lines[0].split() == ["mode", "n", "size", "part", "time", "algbw", "Gb/s",
                                "sent/host", "of", "flat", "bound", "of", "bound", "speed-up"]
    assert set(lines[1]) == {"-"}
    assert lines[2].split()[:3] == ["flat", "4", "4M"]
    assert lines[2].split()[-6:-3] == ["8M", "1.00", "83.9"]
    assert lines[2].split()[-1] == "1.00x"
    hier_cells = lines[3].split()
    assert hier_cells[:6] == ["hierarchical", "4", "4M", "256K", "150.0", "ms"]
    assert hier_cells[7:9] == ["4M", "0.50"] and hier_cells[-1] == "1.67x"
    assert hier.as_dict()["of_flat"] == 0.5


# --- scaling ----------------------------------------------------------------

def test_scaling_plan_pairs_servers_with_workers_by_default():
    plans = ScalingPlan(workers=(4, 1, 2), sizes=(MB,), partition_bytes=256 << 10).cluster_plans()
    assert [(list(p.workers), list(p.servers)) for p in plans] == [([1], [1]), ([2], [2]),
                                                                   ([4], [4])]
    assert all(not p.gloo and list(p.partitions) == [256 << 10] for p in plans)
    fixed = ScalingPlan(workers=(1, 2), sizes=(MB,), servers=2).cluster_plans()
    assert [(list(p.workers), list(p.servers)) for p in fixed] == [([1, 2], [2])]
    for bad in ({"workers": ()}, {"workers": (0,)}, {"servers": 0}, {"sizes": (6,)}):
        with pytest.raises(ValueError, match="Received"):
            ScalingPlan(**bad)


def test_grid_has_one_line_per_size_and_one_column_per_worker_count():
    rows = [Row("bpstrain", 1, 1, 4 * MB, 0.05), Row("bpstrain", 2, 2, 4 * MB, 0.1),
            Row("bpstrain", 1, 1, MB, 0.02)]
    lines = format_grid(rows).splitlines()
    assert lines[0].split() == ["size", "n=1", "k=1", "n=2", "k=2"]
    assert lines[2].split() == ["1M", "20.0", "ms", "(0.419", "Gb/s)", "-"]
    assert lines[3].split() == ["4M", "50.0", "ms", "(0.671", "Gb/s)",
                                "100.0", "ms", "(0.336", "Gb/s)"]


# --- command line and job wiring -------------------------------------------

def test_cli_parses_both_subcommands_with_defaults():
    args = build_parser().parse_args(["hierarchical", "--size", "1M"])
    assert (args.size, args.rate_mbit, args.partition_bytes, args.iters) == (MB, 800.0,
                                                                            256 << 10, 5)
    assert (args.hosts, args.local_size, args.servers) == (2, 2, 2)
    args = build_parser().parse_args(["scaling", "--sizes", "4M", "64M", "--servers", "2"])
    assert (args.sizes, args.workers, args.servers) == ([4 * MB, 64 * MB], [1, 2, 4], 2)


@pytest.mark.parametrize("command", ["hierarchical", "scaling"])
def test_cli_refuses_without_namespaces(monkeypatch, capsys, command):
    monkeypatch.setattr(emulated, "available", lambda: (False, "needs root"))
    assert main([command]) == 2
    assert f"bpstrain.bench {command}: needs root" in capsys.readouterr().err


def test_cli_reports_bad_plan(monkeypatch, capsys):
    monkeypatch.setattr(emulated, "available", lambda: (True, ""))
    assert main(["hierarchical", "--size", "6"]) == 1
    assert "Received: size=6" in capsys.readouterr().err


class _RecordingHosts:
    """Loopback hosts whose processes only print a result line for workers."""

    ifname = "lo"

    def __init__(self):
        self.started = []

    def addr(self, i):
        return f"10.0.0.{i + 1}"

    def next_port(self):
        return 1234

    def popen(self, i, argv, env=None, **kwargs):
        self.started.append((i, dict(env)))
        script = (f"import os; print({MARKER!r} + '{{\"rank\": ' + "
                  "os.environ.get('BYTEPS_LOCAL_RANK', '-1') + '}')")
        return subprocess.Popen([sys.executable, "-c", script], env=env, **kwargs)


@pytest.mark.timeout(60)
def test_ps_job_starts_local_size_workers_per_host():
    hosts = _RecordingHosts()
    payloads = _jobs.run_ps_job(hosts, _jobs.Layout([0, 1], [2], 3, local_size=2),
                                ["unused"], 30, {"BPSTRAIN_HIERARCHICAL": "1"})
    assert [p["rank"] for p in payloads] == [0, 1, 0, 1]
    workers = [(i, env) for i, env in hosts.started if env["DMLC_ROLE"] == "worker"]
    assert [(i, env["DMLC_WORKER_ID"], env["BYTEPS_LOCAL_RANK"]) for i, env in workers] == [
        (0, "0", "0"), (0, "0", "1"), (1, "1", "0"), (1, "1", "1")]
    # BytePS's rule: DMLC_NUM_WORKER counts the 2 hosts; each runs BYTEPS_LOCAL_SIZE=2.
    assert {env["DMLC_NUM_WORKER"] for _, env in hosts.started} == {"2"}
    assert {env["BYTEPS_LOCAL_SIZE"] for _, env in workers} == {"2"}
    assert {env["BPSTRAIN_HIERARCHICAL"] for _, env in hosts.started} == {"1"}


# --- tiny real runs (root + engine) -----------------------------------------

@needs_cluster
@pytest.mark.timeout(180)
def test_hierarchical_bench_halves_bytes_per_host(capsys, tmp_path):
    path = tmp_path / "rows.json"
    assert main(["hierarchical", "--size", "1M", "--iters", "1", "--warmup", "1",
                 "--rate-mbit", "400", "--partition-bytes", "256K", "--json", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[3:]] == ["flat", "hierarchical"]
    records = json.loads(path.read_text())
    assert [r["host_pushed"] for r in records] == [[2 * MB, 2 * MB], [MB, MB]]
    assert records[1]["of_flat"] == 0.5
    assert _mine() == []


@needs_cluster
@pytest.mark.timeout(180)
def test_scaling_bench_prints_grid(capsys):
    assert main(["scaling", "--sizes", "256K", "1M", "--workers", "1", "2", "--iters", "1",
                 "--rate-mbit", "400", "--partition-bytes", "256K"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["size", "n=1", "k=1", "n=2", "k=2"]
    assert [line.split()[0] for line in out[3:]] == ["256K", "1M"]
    assert "-" not in out[3].split()[1:] and "-" not in out[4].split()[1:]
    assert _mine() == []
