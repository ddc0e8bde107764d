"""Per-operation cost of bpstrain's Python layers over the raw binding (loopback)::

    python -m bpstrain.bench overhead                  # 1 KiB, 2 workers, 1 server
    python -m bpstrain.bench overhead --bytes 4K --ops 5000 --blocks 10

A real job on this machine (scheduler, servers and workers, started like the other
loopback benchmarks) times the same small float32 sum three ways in every worker:
the raw ``bpstrain._core`` binding (``worker.enqueue`` + ``worker.wait`` on numpy
arrays), :func:`bpstrain.engine.push_pull` and :func:`bpstrain.torch.push_pull`.
The paths alternate in blocks of ``--ops`` operations inside the same processes, so
all three see the same load; the table shows the median over blocks of the slowest
rank's time per operation, and the median of each path's block-by-block ratio to the
raw binding.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from bpstrain.bench import _jobs, bounds
from bpstrain.bench._hosts import LoopbackHosts
from bpstrain.bench._overhead_worker import PATHS
from bpstrain.bench.table import render

_WORKER = "bpstrain.bench._overhead_worker"


@dataclasses.dataclass
class OverheadPlan:
    """What the overhead benchmark measures."""

    nbytes: int = 1 << 10
    workers: int = 2
    servers: int = 1
    ops: int = 2000
    blocks: int = 11
    warmup: int = 200
    hierarchical: str = "auto"  # comm.hierarchical of the job
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.nbytes < 4 or self.nbytes % 4 or min(self.workers, self.servers, self.ops,
                                                     self.blocks) < 1 or self.warmup < 0:
            raise ValueError(
                "Expected a positive multiple of 4 bytes, workers, servers, ops and blocks >= 1 "
                f"and warmup >= 0. Received: bytes={self.nbytes}, workers={self.workers}, "
                f"servers={self.servers}, ops={self.ops}, blocks={self.blocks}, "
                f"warmup={self.warmup}")


@dataclasses.dataclass
class OverheadRow:
    """One path: median seconds per operation and its ratio to the raw binding."""

    path: str
    per_op_s: float
    vs_raw: float

    def as_dict(self) -> dict:
        """The row as JSON-ready values."""
        return dataclasses.asdict(self)


def run(plan: OverheadPlan, log=None) -> list[OverheadRow]:
    """Runs one job of ``plan.workers`` workers on loopback; returns one row per path."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    log(f"[bench] per-op overhead, {bounds.format_size(plan.nbytes)} float32, {plan.workers} "
        f"workers, {plan.servers} server(s), {plan.blocks} blocks of {plan.ops} ops per path")
    layout = _jobs.Layout(worker_hosts=[0], server_hosts=[0] * plan.servers, scheduler_host=0,
                          local_size=plan.workers)
    argv = [sys.executable, "-m", _WORKER, "--bytes", str(plan.nbytes), "--ops", str(plan.ops),
            "--blocks", str(plan.blocks), "--warmup", str(plan.warmup)]
    payloads = _jobs.run_ps_job(LoopbackHosts(), layout, argv, plan.timeout_s,
                                {"BPSTRAIN_HIERARCHICAL": plan.hierarchical})
    return rows_from(payloads)


def rows_from(payloads: list[dict]) -> list[OverheadRow]:
    """Per path (raw first): the median over blocks of the slowest rank's per-op time, and
    the median over blocks of its ratio to the raw block run just before it.

    The ratio is paired block by block: the paths alternate, so a burst of load on the
    machine lands on neighbouring blocks and cancels in their ratio.
    """
    slowest = {}
    for path in PATHS:
        blocks = zip(*[next(r["times"] for r in p["results"] if r["path"] == path)
                       for p in payloads])
        slowest[path] = [max(ranks) for ranks in blocks]
    raw = slowest[PATHS[0]]
    return [OverheadRow(path, statistics.median(times),
                        statistics.median(t / r for t, r in zip(times, raw)))
            for path, times in slowest.items()]


def format_rows(rows: list[OverheadRow]) -> str:
    """The table: path, us per op, ratio to the raw binding."""
    return render(("path", "us/op", "vs raw"),
                  [(r.path, f"{r.per_op_s * 1e6:.1f}", f"{r.vs_raw:.2f}x") for r in rows])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this benchmark's flags (used by ``bpstrain.bench.cli``)."""
    parser.add_argument("--bytes", dest="nbytes", type=bounds.parse_size, default=1 << 10,
                        help="tensor bytes (1K)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--ops", type=int, default=2000, help="operations per block")
    parser.add_argument("--blocks", type=int, default=11, help="blocks per path")
    parser.add_argument("--warmup", type=int, default=200, help="untimed ops per path")
    parser.add_argument("--hierarchical", choices=["auto", "true", "false"], default="auto",
                        help="comm.hierarchical of the job (auto: shared memory on one host)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the job")


def run_args(args: argparse.Namespace) -> tuple[str, str, list[dict]]:
    """Runs the benchmark for parsed flags; returns ``(title, table, json records)``."""
    plan = OverheadPlan(nbytes=args.nbytes, workers=args.workers, servers=args.servers,
                        ops=args.ops, blocks=args.blocks, warmup=args.warmup,
                        hierarchical=args.hierarchical, timeout_s=args.timeout)
    rows = run(plan)
    torch_row = rows[-1]
    title = (f"per-op cost, {bounds.format_size(plan.nbytes)} float32 sum, {plan.workers} workers "
             f"+ {plan.servers} server(s) on loopback (comm.hierarchical={plan.hierarchical}); "
             f"torch/raw = {torch_row.vs_raw:.2f}")
    return title, format_rows(rows), [r.as_dict() for r in rows]
