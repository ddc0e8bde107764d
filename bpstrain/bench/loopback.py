"""The default benchmark: bpstrain push_pull vs gloo all-reduce on this machine (loopback).

Links are not capped here, so there is no bandwidth bound; the table shows
times, algbw and the ratio to gloo for a large tensor and a small one
(round-trip latency). Two bpstrain rows: ``bpstrain`` is the job as a user starts it
on one host, with no setting: the workers share the host, so they reduce through
shared memory (``comm.hierarchical=auto``) and with a single host no byte needs to
reach the servers (BytePS's single-machine behaviour); ``bpstrain-flat`` is the same
job with ``comm.hierarchical=false`` (every worker talks TCP to the servers).
"""

from __future__ import annotations

import dataclasses
import sys

from bpstrain.bench import _jobs
from bpstrain.bench._hosts import LoopbackHosts
from bpstrain.bench._report import Case
from bpstrain.bench.table import Row, attach_gloo, reduce_times


@dataclasses.dataclass
class LoopbackPlan:
    """What the loopback benchmark measures."""

    size: int = 64 << 20
    workers: int = 2
    servers: int = 2
    iters: int = 10
    warmup: int = 2
    latency_size: int = 4 << 10
    latency_iters: int = 200
    partition_bytes: int | None = None
    gloo: bool = True
    flat: bool = True  # also measure the flat path (comm.hierarchical=false)
    timeout_s: float = 300.0

    def cases(self) -> list[Case]:
        """The large-tensor case and the latency case."""
        return [Case(self.size, self.iters, self.warmup),
                Case(self.latency_size, self.latency_iters, max(1, self.latency_iters // 10))]


def run(plan: LoopbackPlan, log=None) -> list[Row]:
    """Runs gloo (unless disabled) and bpstrain on loopback; returns the table rows."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    hosts = LoopbackHosts()
    cases = plan.cases()
    rows: list[Row] = []
    if plan.gloo:
        log(f"[bench] gloo all_reduce, {plan.workers} ranks, loopback")
        payloads = _jobs.run_gloo(hosts, list(range(plan.workers)), cases, plan.timeout_s)
        rows += [Row("gloo", plan.workers, None, nbytes, t)
                 for nbytes, t in reduce_times(payloads).items()]
    # Every worker on this one host, as `python -m bpstrain.launch --workers N` starts them.
    layout = _jobs.Layout(worker_hosts=[0], server_hosts=list(range(plan.servers)),
                          scheduler_host=0, local_size=plan.workers)
    modes = [("bpstrain", {})] + ([("bpstrain-flat", {"BPSTRAIN_HIERARCHICAL": "0"})]
                                  if plan.flat and plan.workers > 1 else [])
    for system, env in modes:
        log(f"[bench] {system} push_pull, {plan.workers} workers on one host, "
            f"{plan.servers} servers{' (comm.hierarchical=false)' if env else ''}")
        payloads = _jobs.run_bpstrain(hosts, layout, cases, plan.timeout_s, plan.partition_bytes,
                                      env)
        rows += [Row(system, plan.workers, plan.servers, nbytes, t,
                     partition_bytes=plan.partition_bytes)
                 for nbytes, t in reduce_times(payloads).items()]
    attach_gloo(rows)
    rows.sort(key=lambda r: (-r.nbytes, r.system != "gloo"))
    return rows
