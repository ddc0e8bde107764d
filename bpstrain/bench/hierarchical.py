"""Hierarchical vs flat push_pull on the emulated cluster (needs root)::

    python -m bpstrain.bench.hierarchical --rate-mbit 800 --size 64M \
        --partition-bytes 256K --iters 5

Host layout (every link capped at ``--rate-mbit`` up and down)::

    hosts 0 .. H-1        worker hosts, L worker processes each (DMLC_WORKER_ID = host,
                          BYTEPS_LOCAL_RANK 0..L-1, BYTEPS_LOCAL_SIZE = L)
    hosts H .. H+K-1      one server each
    host  H+K             the scheduler

The same job runs twice in one cluster: flat (``BPSTRAIN_HIERARCHICAL=0``; every
process push_pulls the whole tensor) and hierarchical (``=1``; the local ranks
reduce through shared memory and each push_pulls only its slice). A host then
sends M instead of L*M bytes to the servers, so with the links as the
bottleneck hierarchical should be up to L times faster. Columns of the table:

* ``time``, ``algbw``: as in ``bpstrain.bench.table``;
* ``sent/host``: bytes one host pushed to the servers per call (sum of
  ``engine.stats()['bytes_pushed']`` over its local ranks, mean over hosts);
* ``of flat``: sent/host as a fraction of the flat run's (expected: 1/L);
* ``bound``: the links' lower bound for that mode (``bounds.ps_bound_s`` on the
  bytes a host sends); ``speed-up``: flat time / time.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Sequence

from bpstrain.bench import _jobs, bounds
from bpstrain.bench._hosts import EmulatedHosts
from bpstrain.bench._report import Case
from bpstrain.bench.emulated import EmulatedCluster
from bpstrain.bench.table import format_time, reduce_times, render

MODES = (("flat", "0"), ("hierarchical", "1"))


@dataclasses.dataclass
class HierPlan:
    """What the hierarchical benchmark measures."""

    size: int = 64 << 20
    rate_mbit: float = 800.0
    partition_bytes: int | None = 256 << 10
    iters: int = 5
    warmup: int = 1
    worker_hosts: int = 2
    local_size: int = 2
    servers: int = 2
    latency_ms: float = 20.0

    def __post_init__(self) -> None:
        if self.size < 4 or self.size % 4:
            raise ValueError(f"Expected a positive multiple of 4 bytes (float32). "
                             f"Received: size={self.size}")
        if min(self.worker_hosts, self.local_size, self.servers, self.iters) < 1:
            raise ValueError("Expected worker_hosts, local_size, servers and iters >= 1. "
                             f"Received: worker_hosts={self.worker_hosts}, local_size="
                             f"{self.local_size}, servers={self.servers}, iters={self.iters}")

    @property
    def num_hosts(self) -> int:
        """Hosts the run needs: worker hosts, one per server, the scheduler."""
        return self.worker_hosts + self.servers + 1

    @property
    def workers(self) -> int:
        """Worker processes (``DMLC_NUM_WORKER``)."""
        return self.worker_hosts * self.local_size

    def layout(self) -> _jobs.Layout:
        """Worker hosts first, then server hosts, then the scheduler's host."""
        h, k = self.worker_hosts, self.servers
        return _jobs.Layout(list(range(h)), list(range(h, h + k)), h + k, self.local_size)

    def bound_s(self, hierarchical: bool) -> float:
        """Links' lower bound on one call: a host sends M (hierarchical) or L*M (flat)."""
        per_host = self.size if hierarchical else self.local_size * self.size
        return bounds.ps_bound_s(per_host, self.worker_hosts, self.servers,
                                 bounds.link_bytes_per_s(self.rate_mbit))

    def timeout_s(self) -> float:
        """A generous deadline for one job: 4x the flat bound per call, plus start-up."""
        return 120.0 + 4.0 * self.bound_s(False) * (self.iters + self.warmup + 1)


@dataclasses.dataclass
class HierRow:
    """One mode's measurement."""

    mode: str
    workers: int
    nbytes: int
    time_s: float
    host_pushed: list[int]
    partition_bytes: int | None = None
    bound_s: float | None = None
    flat_time_s: float | None = None
    flat_pushed: float | None = None

    @property
    def algbw_bps(self) -> float:
        """Algorithm bandwidth in bytes/s."""
        return self.nbytes / self.time_s if self.time_s > 0 else float("inf")

    @property
    def pushed_per_host(self) -> float:
        """Mean over hosts of the bytes a host pushed to the servers per call."""
        return statistics.fmean(self.host_pushed)

    def as_dict(self) -> dict:
        """Plain dict with the derived columns, for ``--json`` output."""
        data = dataclasses.asdict(self)
        data["algbw_bps"] = self.algbw_bps
        data["of_flat"] = self.pushed_per_host / self.flat_pushed if self.flat_pushed else None
        data["speedup"] = self.flat_time_s / self.time_s if self.flat_time_s else None
        return data


def make_row(mode: str, plan: HierPlan, payloads: Sequence[dict]) -> HierRow:
    """Reduces one job's worker payloads (in rank order) to a row."""
    per_rank = [next(r["bytes_pushed"] for r in p["results"] if r["bytes"] == plan.size)
                for p in payloads]
    local = plan.local_size
    host_pushed = [sum(per_rank[h * local:(h + 1) * local]) for h in range(plan.worker_hosts)]
    return HierRow(mode, plan.workers, plan.size, reduce_times(payloads)[plan.size],
                   host_pushed, plan.partition_bytes,
                   plan.bound_s(mode == "hierarchical"))


def attach_flat(rows: list[HierRow]) -> None:
    """Fills every row's ``flat_*`` fields from the flat row."""
    flat = next((r for r in rows if r.mode == "flat"), None)
    for row in rows:
        row.flat_time_s = flat.time_s if flat else None
        row.flat_pushed = flat.pushed_per_host if flat else None


def run(plan: HierPlan, log=None) -> list[HierRow]:
    """Builds the emulated cluster, runs flat then hierarchical, tears it down."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    argv = [sys.executable, "-m", "bpstrain.bench._hier_worker",
            *_jobs._case_args([Case(plan.size, plan.iters, plan.warmup)])]
    extra = {}
    if plan.partition_bytes:
        argv += ["--partition-bytes", str(plan.partition_bytes)]
        extra["BYTEPS_PARTITION_BYTES"] = str(plan.partition_bytes)
    rows = []
    log(f"[bench] emulated cluster: {plan.num_hosts} hosts at {plan.rate_mbit:g} Mbit/s")
    with EmulatedCluster(plan.num_hosts, plan.rate_mbit, latency_ms=plan.latency_ms) as cluster:
        hosts = EmulatedHosts(cluster)
        for mode, flag in MODES:
            log(f"[bench] {mode} push_pull: {plan.worker_hosts} worker hosts x "
                f"{plan.local_size} local ranks, {plan.servers} server hosts")
            payloads = _jobs.run_ps_job(hosts, plan.layout(), argv, plan.timeout_s(),
                                        {**extra, "BPSTRAIN_HIERARCHICAL": flag})
            rows.append(make_row(mode, plan, payloads))
    attach_flat(rows)
    return rows


_HEADERS = ("mode", "n", "size", "part", "time", "algbw Gb/s", "sent/host", "of flat",
            "bound", "of bound", "speed-up")


def format_table(rows: Sequence[HierRow]) -> str:
    """Renders the rows as an aligned plain-text table."""
    return render(_HEADERS, [(
        r.mode,
        str(r.workers),
        bounds.format_size(r.nbytes),
        "-" if r.partition_bytes is None else bounds.format_size(r.partition_bytes),
        format_time(r.time_s),
        f"{r.algbw_bps * 8 / 1e9:.3f}",
        bounds.format_size(round(r.pushed_per_host)),
        "-" if not r.flat_pushed else f"{r.pushed_per_host / r.flat_pushed:.2f}",
        "-" if r.bound_s is None else format_time(r.bound_s),
        "-" if r.bound_s is None else f"{r.bound_s / r.time_s:.2f}",
        "-" if r.flat_time_s is None else f"{r.flat_time_s / r.time_s:.2f}x",
    ) for r in rows])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this benchmark's flags (used by ``bpstrain.bench.cli``)."""
    parse_size = bounds.parse_size
    parser.add_argument("--rate-mbit", type=float, default=800.0,
                        help="per-host upload and download cap, Mbit/s")
    parser.add_argument("--size", type=parse_size, default=64 << 20, help="tensor bytes (64M)")
    parser.add_argument("--partition-bytes", type=parse_size, default=256 << 10)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--hosts", type=int, default=2, help="worker hosts")
    parser.add_argument("--local-size", type=int, default=2, help="worker processes per host")
    parser.add_argument("--servers", type=int, default=2, help="server hosts")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="tbf queue latency")


def run_args(args: argparse.Namespace) -> tuple[str, str, list[dict]]:
    """Runs the benchmark for parsed flags; returns ``(title, table, json records)``."""
    plan = HierPlan(size=args.size, rate_mbit=args.rate_mbit,
                    partition_bytes=args.partition_bytes, iters=args.iters,
                    warmup=args.warmup, worker_hosts=args.hosts, local_size=args.local_size,
                    servers=args.servers, latency_ms=args.latency_ms)
    rows = run(plan)
    title = (f"hierarchical vs flat, {plan.worker_hosts} worker hosts x {plan.local_size} "
             f"local ranks, {plan.servers} server hosts, {plan.rate_mbit:g} Mbit/s per host "
             "(sent/host = bytes a host pushes to servers per call; speed-up = flat time / time)")
    return title, format_table(rows), [r.as_dict() for r in rows]


def main(argv: list[str] | None = None) -> int:
    """``python -m bpstrain.bench.hierarchical``, i.e. ``python -m bpstrain.bench hierarchical``."""
    from bpstrain.bench import cli

    return cli.main(["hierarchical", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
