"""``python -m bpstrain.bench.keras_resnet``: Keras ResNet-50 training throughput vs workers.

Every worker trains ``keras.applications.ResNet50(weights=None)`` on synthetic images
(``bpstrain.keras.examples.resnet50_synthetic``) through ``model.fit`` with
``bpstrain.keras.DistributedOptimizer`` and ``BytePSCallback``. One job per worker
count; the table gives the job's samples/s (sum over workers) and the scaling
efficiency ``samples/s(n) / (n * samples/s(1))``.

Examples::

    python -m bpstrain.bench.keras_resnet             # 1, 2, 4 workers, emulated hosts (root)
    python -m bpstrain.bench.keras_resnet --workers 1 2 --rate-mbit 800 --steps 12
    python -m bpstrain.bench.keras_resnet --loopback  # no root: all on 127.0.0.1

Host layout on the emulated cluster (each host's up- and download capped at
``--rate-mbit``): workers on hosts 0..N-1, servers on the next K hosts, the scheduler
on the last. All hosts share this machine's CPUs: on a small machine the numbers say
how much the CPUs, not the network, limit scaling (read them with ``nproc`` in mind).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from bpstrain.bench import _jobs
from bpstrain.bench._hosts import EmulatedHosts, Hosts, LoopbackHosts


@dataclasses.dataclass
class Plan:
    """What one benchmark run measures."""

    workers: Sequence[int] = (1, 2, 4)
    servers: int = 1
    rate_mbit: float = 10_000.0
    batch_size: int = 16
    image_size: int = 64
    steps: int = 8
    warmup_steps: int = 2
    threads: int = 1
    backend: str = "tensorflow"
    loopback: bool = False
    timeout_s: float = 900.0

    def worker_argv(self) -> list[str]:
        """Command line of one benchmark worker."""
        return [sys.executable, "-m", "bpstrain.bench._keras_resnet_worker",
                "--batch-size", str(self.batch_size), "--image-size", str(self.image_size),
                "--steps", str(self.steps), "--warmup-steps", str(self.warmup_steps),
                "--threads", str(self.threads)]


def run(plan: Plan, log=None) -> list[dict]:
    """Runs one job per worker count; returns one row per job."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if plan.loopback:
        return _run_all(LoopbackHosts(), plan, log)
    from bpstrain.bench.emulated import EmulatedCluster

    hosts = max(plan.workers) + plan.servers + 1
    log(f"[keras_resnet] emulated cluster: {hosts} hosts at {plan.rate_mbit:g} Mbit/s")
    with EmulatedCluster(hosts, plan.rate_mbit) as cluster:
        return _run_all(EmulatedHosts(cluster), plan, log)


def _run_all(hosts: Hosts, plan: Plan, log) -> list[dict]:
    rows = []
    max_n = max(plan.workers)
    for n in plan.workers:
        layout = _jobs.Layout(list(range(n)), list(range(max_n, max_n + plan.servers)),
                              max_n + plan.servers)
        log(f"[keras_resnet] {n} worker(s), {plan.servers} server(s)")
        payloads = _run_job(hosts, layout, plan)
        results = [p["results"][0] for p in payloads]
        rows.append({"workers": n, "samples_per_s": sum(r["samples_per_s"] for r in results),
                     "step_s": max(r["step_s"] for r in results)})
    base = next((r["samples_per_s"] for r in rows if r["workers"] == 1), None)
    for row in rows:
        row["efficiency"] = row["samples_per_s"] / (row["workers"] * base) if base else None
    return rows


def _run_job(hosts: Hosts, layout: _jobs.Layout, plan: Plan) -> list[dict]:
    return _jobs.run_ps_job(hosts, layout, plan.worker_argv(), plan.timeout_s,
                            {"KERAS_BACKEND": plan.backend, "TF_CPP_MIN_LOG_LEVEL": "2"})


def format_rows(rows: list[dict], plan: Plan) -> str:
    """The result table, with a title line describing the setup."""
    where = "loopback" if plan.loopback else f"emulated hosts at {plan.rate_mbit:g} Mbit/s"
    lines = [f"Keras ResNet-50 ({plan.image_size}x{plan.image_size}, batch {plan.batch_size}"
             f"/worker, {plan.backend} backend, {plan.threads} thread(s)/worker), {where}, "
             f"{plan.servers} server(s), {os.cpu_count()} CPUs",
             f"{'workers':>7}  {'samples/s':>9}  {'per worker':>10}  {'ms/step':>7}  "
             f"{'scaling eff.':>12}"]
    for r in rows:
        eff = f"{100 * r['efficiency']:.0f}%" if r["efficiency"] is not None else "-"
        lines.append(f"{r['workers']:>7}  {r['samples_per_s']:>9.1f}  "
                     f"{r['samples_per_s'] / r['workers']:>10.1f}  {1000 * r['step_s']:>7.0f}  "
                     f"{eff:>12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m bpstrain.bench.keras_resnet")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--rate-mbit", type=float, default=10_000.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="batches per worker")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed batches")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per worker")
    parser.add_argument("--backend", choices=["tensorflow", "torch"], default="tensorflow")
    parser.add_argument("--loopback", action="store_true", help="no namespaces (no root)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    args = parser.parse_args(argv)
    plan = Plan(args.workers, args.servers, args.rate_mbit, args.batch_size, args.image_size,
                args.steps, args.warmup_steps, args.threads, args.backend, args.loopback,
                args.timeout)
    if min(plan.workers) < 1 or plan.servers < 1 or plan.steps <= plan.warmup_steps:
        print("keras_resnet: expected workers >= 1, servers >= 1 and steps > warmup-steps. "
              f"Received: workers={plan.workers}, servers={plan.servers}, steps={plan.steps}, "
              f"warmup-steps={plan.warmup_steps}", file=sys.stderr)
        return 2
    if not plan.loopback:
        from bpstrain.bench import emulated

        ok, reason = emulated.available()
        if not ok:
            print(f"keras_resnet: {reason}; use --loopback.", file=sys.stderr)
            return 2
    try:
        rows = run(plan)
    except (_jobs.BenchError, ValueError) as exc:
        print(f"keras_resnet: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("keras_resnet: interrupted; processes and namespaces were removed.", file=sys.stderr)
        return 130
    print(format_rows(rows, plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
