"""The emulated-cluster benchmark: bpstrain and gloo on the same rate-capped hosts.

Host layout of one run (all jobs share it, one job at a time)::

    hosts 0 .. N-1        workers (gloo ranks and bpstrain workers), N = max(workers)
    hosts N .. N+K-1      bpstrain servers, K = max(servers)
    host  N+K             the scheduler (or host 0 with scheduler="host0")

With ``mixed`` every worker host also runs a server (BytePS's mixed mode) and the
``servers`` values count the dedicated server hosts only (0 allowed); the bound is
then :func:`bpstrain.bench.bounds.mixed_bound_s`.

Every host's upload and download are capped at ``rate_mbit``; the bounds use
that rate as B (see ``bpstrain.bench.bounds``). ``transports`` runs the bpstrain jobs
once per ``comm.transport`` (``tcp``, ``ucx:tcp``, ...), on the same hosts in the same run.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Sequence

from bpstrain.bench import _jobs, bounds
from bpstrain.bench._hosts import EmulatedHosts
from bpstrain.bench._report import Case
from bpstrain.bench.emulated import EmulatedCluster
from bpstrain.bench.table import Row, attach_gloo, reduce_times


@dataclasses.dataclass
class ClusterPlan:
    """What the cluster benchmark measures."""

    workers: Sequence[int] = (2,)
    servers: Sequence[int] = (2,)
    sizes: Sequence[int] = (4 << 20, 64 << 20)
    rate_mbit: float = 800.0
    partitions: Sequence[int | None] = (None,)
    iters: int = 5
    warmup: int = 1
    scheduler: str = "own"
    gloo: bool = True
    latency_ms: float = 20.0
    mixed: bool = False
    transports: Sequence[str] = ("tcp",)

    def __post_init__(self) -> None:
        if self.scheduler not in ("own", "host0"):
            raise ValueError(f"Expected scheduler 'own' or 'host0'. Received: {self.scheduler!r}")
        if min(self.workers) < 1 or min(self.servers) < (0 if self.mixed else 1):
            raise ValueError("Expected at least one worker and one server (0 dedicated servers "
                             f"only with mixed). Received: workers={list(self.workers)}, "
                             f"servers={list(self.servers)}")

    @property
    def num_hosts(self) -> int:
        """Hosts the run needs."""
        return max(self.workers) + max(self.servers) + (self.scheduler == "own")

    def cases(self) -> list[Case]:
        """One case per size, largest first."""
        return [Case(m, self.iters, self.warmup) for m in sorted(self.sizes, reverse=True)]

    def timeout_s(self, workers: int, servers: int) -> float:
        """A generous deadline for one job: 4x the slower bound per call, plus start-up."""
        link = bounds.link_bytes_per_s(self.rate_mbit)
        calls = self.iters + self.warmup + 1
        slowest = sum(max(bounds.ps_bound_s(m, workers, max(servers, 1), link),
                          bounds.ring_bound_s(m, workers, link), m / link) * calls
                      for m in self.sizes)
        return 120.0 + 4.0 * slowest


def run(plan: ClusterPlan, log=None) -> list[Row]:
    """Builds the emulated cluster, runs every job, tears it down; returns the rows."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    link = bounds.link_bytes_per_s(plan.rate_mbit)
    max_n, max_k = max(plan.workers), max(plan.servers)
    server_pool = list(range(max_n, max_n + max_k))
    scheduler_host = max_n + max_k if plan.scheduler == "own" else 0
    rows: list[Row] = []
    log(f"[bench] emulated cluster: {plan.num_hosts} hosts at {plan.rate_mbit:g} Mbit/s")
    with EmulatedCluster(plan.num_hosts, plan.rate_mbit, latency_ms=plan.latency_ms) as cluster:
        hosts = EmulatedHosts(cluster)
        for n in plan.workers:
            worker_hosts = list(range(n))
            if plan.gloo and n > 1:
                log(f"[bench] gloo all_reduce, {n} worker hosts")
                payloads = _jobs.run_gloo(hosts, worker_hosts, plan.cases(),
                                          plan.timeout_s(n, 1))
                rows += [Row("gloo", n, None, m, t, link_bps=link,
                             bound_s=bounds.ring_bound_s(m, n, link))
                         for m, t in reduce_times(payloads).items()]
            for k, part, transport in itertools.product(plan.servers, plan.partitions,
                                                        plan.transports):
                log(f"[bench] bpstrain push_pull, {n} worker hosts, {k} server hosts"
                    + (" + a server on each worker host" if plan.mixed else "")
                    + (f", partition {bounds.format_size(part)}" if part else "")
                    + (f", transport {transport}" if transport != "tcp" else ""))
                layout = _jobs.Layout(worker_hosts, server_pool[:k], scheduler_host,
                                      colocated=plan.mixed)
                payloads = _jobs.run_bpstrain(hosts, layout, plan.cases(),
                                              plan.timeout_s(n, k), part,
                                              {"BPSTRAIN_TRANSPORT": transport})
                system = "bpstrain-mixed" if plan.mixed else "bpstrain"
                rows += [Row(system if transport == "tcp" else f"{system} {transport}",
                             n, k, m, t, partition_bytes=part, link_bps=link,
                             bound_s=_bound(plan.mixed, m, n, k, link))
                         for m, t in reduce_times(payloads).items()]
    attach_gloo(rows)
    return _sorted(rows)


def _bound(mixed: bool, nbytes: int, n: int, k: int, link: float) -> float:
    if mixed:
        return bounds.mixed_bound_s(nbytes, n, k, link)
    return bounds.ps_bound_s(nbytes, n, k, link)


def _sorted(rows: list[Row]) -> list[Row]:
    rows.sort(key=lambda r: (r.workers, -r.nbytes, r.system != "gloo",
                             r.servers or 0, r.partition_bytes or 0))
    return rows
