"""How bpstrain's push_pull time scales with workers and tensor size (emulated, root)::

    python -m bpstrain.bench.scaling --rate-mbit 800 --sizes 4M 64M 256M --workers 1 2 4
    python -m bpstrain.bench.scaling --workers 1 2 4 --servers 2   # fixed server count

Each worker and each server is on its own emulated host, every link capped at
``--rate-mbit``. By default a job with n workers has n servers (``k = n``: the
links, not the servers, should bound the time, so it should stay flat as n
grows); ``--servers K`` fixes k instead. The jobs are ``bpstrain.bench.cluster``
jobs (one ``ClusterPlan`` per worker count when k = n, one in all otherwise).

The table has one row per size and one column per worker count; each cell is
``time (algbw)``: median of the slowest rank's time, and M / time in Gbit/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from bpstrain.bench import bounds, cluster
from bpstrain.bench.table import Row, format_time, render


@dataclasses.dataclass
class ScalingPlan:
    """What the scaling benchmark measures."""

    workers: Sequence[int] = (1, 2, 4)
    sizes: Sequence[int] = (4 << 20, 64 << 20, 256 << 20)
    servers: int | None = None
    rate_mbit: float = 800.0
    partition_bytes: int | None = None
    iters: int = 5
    warmup: int = 1
    latency_ms: float = 20.0

    def __post_init__(self) -> None:
        bad_servers = self.servers is not None and self.servers < 1
        if not self.workers or min(self.workers) < 1 or bad_servers:
            raise ValueError("Expected worker counts >= 1 and servers >= 1 (or None for "
                             f"k = n). Received: workers={list(self.workers)}, "
                             f"servers={self.servers}")
        if not self.sizes or min(self.sizes) < 4 or any(m % 4 for m in self.sizes):
            raise ValueError("Expected sizes that are positive multiples of 4 bytes "
                             f"(float32). Received: sizes={list(self.sizes)}")
        self.workers = sorted(set(self.workers))

    def cluster_plans(self) -> list[cluster.ClusterPlan]:
        """The ``ClusterPlan``s to run: one per worker count when k = n, else one."""
        common = dict(sizes=tuple(self.sizes), rate_mbit=self.rate_mbit,
                      partitions=(self.partition_bytes,), iters=self.iters,
                      warmup=self.warmup, gloo=False, latency_ms=self.latency_ms)
        if self.servers is None:
            return [cluster.ClusterPlan(workers=(n,), servers=(n,), **common)
                    for n in self.workers]
        return [cluster.ClusterPlan(workers=tuple(self.workers), servers=(self.servers,),
                                    **common)]


def run(plan: ScalingPlan, log=None) -> list[Row]:
    """Runs every job of ``plan`` (see ``bpstrain.bench.cluster.run``); returns the rows."""
    return [row for p in plan.cluster_plans() for row in cluster.run(p, log)]


def format_grid(rows: Sequence[Row]) -> str:
    """One line per size (ascending), one column per (n, k): ``time (algbw Gb/s)``."""
    columns = sorted({(r.workers, r.servers) for r in rows})
    cells = {(r.nbytes, r.workers, r.servers): r for r in rows}
    lines = []
    for nbytes in sorted({r.nbytes for r in rows}):
        line = [bounds.format_size(nbytes)]
        for n, k in columns:
            r = cells.get((nbytes, n, k))
            line.append("-" if r is None else
                        f"{format_time(r.time_s)} ({r.algbw_bps * 8 / 1e9:.3f} Gb/s)")
        lines.append(line)
    return render(["size", *(f"n={n} k={k}" for n, k in columns)], lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this benchmark's flags (used by ``bpstrain.bench.cli``)."""
    parser.add_argument("--rate-mbit", type=float, default=800.0,
                        help="per-host upload and download cap, Mbit/s")
    parser.add_argument("--sizes", type=bounds.parse_size, nargs="+",
                        default=[4 << 20, 64 << 20, 256 << 20])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--servers", type=int, default=None,
                        help="server hosts for every job (default: as many as workers)")
    parser.add_argument("--partition-bytes", type=bounds.parse_size, default=None)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--latency-ms", type=float, default=20.0, help="tbf queue latency")


def run_args(args: argparse.Namespace) -> tuple[str, str, list[dict]]:
    """Runs the benchmark for parsed flags; returns ``(title, table, json records)``."""
    plan = ScalingPlan(workers=args.workers, sizes=args.sizes, servers=args.servers,
                       rate_mbit=args.rate_mbit, partition_bytes=args.partition_bytes,
                       iters=args.iters, warmup=args.warmup, latency_ms=args.latency_ms)
    rows = run(plan)
    part = bounds.format_size(plan.partition_bytes) if plan.partition_bytes else "default"
    title = (f"bpstrain push_pull scaling, {plan.rate_mbit:g} Mbit/s per host, partition "
             f"{part} (n workers, k servers; cell = time (algbw))")
    return title, format_grid(rows), [r.as_dict() for r in rows]


def main(argv: list[str] | None = None) -> int:
    """``python -m bpstrain.bench.scaling``: same as ``python -m bpstrain.bench scaling``."""
    from bpstrain.bench import cli

    return cli.main(["scaling", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
