"""Sparse embeddings: bpstrain's row-sparse push_pull against bpstrain dense and torch DDP
(gloo) with sparse embeddings, on a DLRM-like model generated in code::

    python -m bpstrain.bench sparse                           # 4 worker + 4 server hosts, 800 Mbit/s
    python -m bpstrain.bench sparse --rows 100000 --loopback  # smoke, no root

Every system trains the model of :mod:`bpstrain.bench._sparse_worker` (an EmbeddingBag of
``--rows`` x ``--dim`` fp32, batch ``--batch`` x ``--fields`` Zipf ids per worker, a linear
head, SGD) on the emulated cluster (worker hosts 0..H-1, server hosts H..H+K-1, the
scheduler on H+K, every link capped with ``tc tbf``; DDP on the worker hosts). Systems:
bpstrain-sparse (row-sparse push_pull of the embedding's gradient), bpstrain-table (the
table kept by the servers, ``ServerEmbeddingBag``), bpstrain-prefetch (the same, each step
prefetching the next batch's rows while its push is in flight), bpstrain-dense, ddp (gloo,
sparse gradients). Columns: the median over steps of the slowest worker's step; the bytes each
worker host's link sent and received per step (its namespace's interface counters; mean
over workers); the least a worker must send and receive per step (bpstrain-sparse: ids +
its unique rows x row bytes up, ids + the union's rows down; bpstrain-table and -prefetch:
ids twice + its unique rows' gradients up, its unique rows down) and the measured/bound
ratios; how much faster bpstrain-sparse, bpstrain-table and bpstrain-prefetch are than each
system, in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Sequence

from bpstrain.bench import _jobs, emulated
from bpstrain.bench._hosts import EmulatedHosts, LoopbackHosts
from bpstrain.bench.training import ps_layout, run_ddp_job

_WORKER = "bpstrain.bench._sparse_worker"
SYSTEMS = ("bpstrain-sparse", "bpstrain-table", "bpstrain-prefetch", "bpstrain-dense", "ddp")


@dataclasses.dataclass
class SparsePlan:
    systems: Sequence[str] = SYSTEMS
    hosts: int = 4
    servers: int = 4
    rate_mbit: float = 800.0
    rows: int = 4_000_000
    dim: int = 64
    batch: int = 1024
    fields: int = 26
    zipf: float = 1.05
    steps: int = 10
    dense_steps: int = 2  # a dense step moves the whole table: a few are enough
    warmup: int = 1
    loopback: bool = False
    timeout_s: float = 900.0


@dataclasses.dataclass
class SparseRow:
    system: str
    step_s: float
    tx_per_step: float  # bytes a worker host sent per step (mean over workers)
    rx_per_step: float
    push_bound: float | None = None  # what the worker must send per step (see _row)
    pull_bound: float | None = None  # what it must receive
    speedup: float | None = None  # this step / bpstrain-sparse's (how much faster sparse is)
    table_speedup: float | None = None  # this step / bpstrain-table's
    prefetch_speedup: float | None = None  # this step / bpstrain-prefetch's


def _row(system: str, payloads: list[dict], dim: int) -> SparseRow:
    res = [p["results"][0] for p in payloads]
    steps = len(res[0]["times"])
    step = statistics.median(max(ts) for ts in zip(*[r["times"] for r in res]))
    row = SparseRow(system, step, statistics.mean(r["tx"] for r in res) / steps,
                    statistics.mean(r["rx"] for r in res) / steps)
    own = statistics.mean(statistics.mean(r["own_rows"]) for r in res)
    if system == "bpstrain-sparse":  # push own rows with ids, pull the union with ids
        row.push_bound = own * (8 + 4 * dim)
        row.pull_bound = statistics.mean(statistics.mean(r["union_rows"]) for r in res) * (8 + 4 * dim)
    elif system in ("bpstrain-table", "bpstrain-prefetch"):  # ids to pull, ids + gradients to push; own rows back
        row.push_bound, row.pull_bound = own * (16 + 4 * dim), own * 4 * dim
    return row


def run(plan: SparsePlan, log=None) -> list[SparseRow]:
    """One job per system on freshly built hosts; returns the rows."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    for system in plan.systems:
        if system not in SYSTEMS:
            raise ValueError(f"Expected systems among {', '.join(SYSTEMS)}. Received: {system!r}")
    layout = ps_layout(plan.hosts, plan.servers, plan.loopback)
    rows = []
    for system in plan.systems:
        if plan.loopback:
            hosts, cluster = LoopbackHosts(), None
        else:
            count = plan.hosts + plan.servers + 1
            cluster = emulated.EmulatedCluster(count, [plan.rate_mbit] * count)
            hosts = EmulatedHosts(cluster)
        steps = plan.dense_steps if system == "bpstrain-dense" else plan.steps
        argv = [sys.executable, "-m", _WORKER, "--system", system, "--rows", str(plan.rows), "--dim",
                str(plan.dim), "--batch", str(plan.batch), "--fields", str(plan.fields), "--zipf",
                str(plan.zipf), "--steps", str(steps), "--warmup", str(plan.warmup), "--ifname", hosts.ifname]
        log(f"[sparse] {system}: {plan.hosts} worker hosts, {plan.servers} server hosts, "
            f"{'loopback' if plan.loopback else f'{plan.rate_mbit:g} Mbit/s'}")
        try:
            if system == "ddp":
                payloads = run_ddp_job(hosts, plan.hosts, argv, plan.timeout_s)
            else:
                payloads = _jobs.run_ps_job(hosts, layout, [*argv, "--timeout", str(plan.timeout_s)],
                                            plan.timeout_s, {"BPSTRAIN_OP_TIMEOUT": str(int(plan.timeout_s))})
        finally:
            if cluster is not None:
                cluster.close()
        rows.append(_row(system, payloads, plan.dim))
    step = {r.system: r.step_s for r in rows}
    for r in rows:
        if "bpstrain-sparse" in step:
            r.speedup = r.step_s / step["bpstrain-sparse"]
        if "bpstrain-table" in step:
            r.table_speedup = r.step_s / step["bpstrain-table"]
        if "bpstrain-prefetch" in step:
            r.prefetch_speedup = r.step_s / step["bpstrain-prefetch"]
    return rows


def format_table(rows: Sequence[SparseRow]) -> str:
    head = (f"{'system':<17} {'step':>10} {'tx/step':>10} {'rx/step':>10} {'push bound':>11} "
            f"{'pull bound':>11} {'tx/bound':>9} {'rx/bound':>9} {'sparse is':>10} {'table is':>10} "
            f"{'prefetch is':>11}")
    lines = [head, "-" * len(head)]
    mb = lambda b: f"{b / 1e6:8.2f} MB" if b is not None else f"{'-':>11}"
    for r in rows:
        tx_ratio = f"{r.tx_per_step / r.push_bound:8.2f}x" if r.push_bound else f"{'-':>9}"
        rx_ratio = f"{r.rx_per_step / r.pull_bound:8.2f}x" if r.pull_bound else f"{'-':>9}"
        speed = lambda x: f"{x:8.1f}x" if x is not None else f"{'-':>9}"
        lines.append(f"{r.system:<17} {r.step_s * 1e3:7.1f} ms {r.tx_per_step / 1e6:7.2f} MB "
                     f"{r.rx_per_step / 1e6:7.2f} MB {mb(r.push_bound)} {mb(r.pull_bound)} {tx_ratio} "
                     f"{rx_ratio} {speed(r.speedup):>10} {speed(r.table_speedup):>10} "
                     f"{speed(r.prefetch_speedup):>11}")
    return "\n".join(lines)


def needs_root(args: argparse.Namespace) -> bool:
    """Whether these flags build emulated hosts."""
    return not args.loopback


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this benchmark's flags (used by ``bpstrain.bench.cli``)."""
    d = SparsePlan()
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--hosts", type=int, default=d.hosts, help="worker hosts (one worker each)")
    parser.add_argument("--servers", type=int, default=d.servers, help="server hosts")
    parser.add_argument("--rate-mbit", type=float, default=d.rate_mbit, help="per-host link cap")
    parser.add_argument("--rows", type=int, default=d.rows, help="embedding rows")
    parser.add_argument("--dim", type=int, default=d.dim, help="embedding width")
    parser.add_argument("--batch", type=int, default=d.batch, help="samples per worker")
    parser.add_argument("--fields", type=int, default=d.fields, help="ids per sample")
    parser.add_argument("--zipf", type=float, default=d.zipf, help="Zipf exponent of the ids")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--dense-steps", type=int, default=d.dense_steps)
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument("--loopback", action="store_true", help="no namespaces, no caps (no root)")
    parser.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds per job")


def run_args(args: argparse.Namespace) -> tuple[str, str, list[dict]]:
    """Runs the benchmark for parsed flags; returns ``(title, table, json records)``."""
    plan = SparsePlan(systems=args.systems, hosts=args.hosts, servers=args.servers, rate_mbit=args.rate_mbit,
                      rows=args.rows, dim=args.dim, batch=args.batch, fields=args.fields, zipf=args.zipf,
                      steps=args.steps, dense_steps=args.dense_steps, warmup=args.warmup,
                      loopback=args.loopback, timeout_s=args.timeout)
    rows = run(plan)
    where = "loopback" if plan.loopback else f"{plan.rate_mbit:g} Mbit/s per host"
    title = (f"sparse embeddings: {plan.hosts} workers, {plan.servers} servers, {where}, "
             f"{plan.rows} x {plan.dim} fp32, batch {plan.batch} x {plan.fields} Zipf({plan.zipf:g}) ids")
    return title, format_table(rows), [dataclasses.asdict(r) for r in rows]
