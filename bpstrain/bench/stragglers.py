"""Stragglers: synchronous training against k-of-n aggregation (backup workers),
bounded staleness and asynchronous training (the optimizer on the servers).

    python -m bpstrain.bench stragglers                       # 4 worker + 2 server hosts, 800 Mbit/s
    python -m bpstrain.bench stragglers --scenarios none transient persistent slowlink
    python -m bpstrain.bench stragglers --loopback --steps 20 # smoke, no root

Each (scenario, system) is one bpstrain job on emulated hosts (worker hosts 0..H-1,
server hosts H..H+K-1, the scheduler on H+K, every link capped at ``--rate-mbit``)
training the digits MLP with ``DistributedOptimizer`` (see
:mod:`bpstrain.bench._straggler_worker` for the emulated compute and the stalls).
Systems: ``sync`` (``comm.aggregate=all``), ``k:<K>`` (``comm.aggregate=k:<K>`` with
``DistributedOptimizer(catch_up=True)``: a worker that fell behind skips the rounds the
others finished, every worker's loop ending by rounds),
``ssp:<s>`` and ``async`` (``comm.consistency``: the servers hold the weights and step
SGD with momentum), and ``tf-ps``: TensorFlow's ``ParameterServerStrategy`` on the same
hosts (workers on the worker hosts, parameter servers on the server hosts, the
coordinator on the scheduler's; :mod:`bpstrain.bench._tf_ps_worker`), whose step time
is the run's mean (the coordinator does not see single steps).
Scenarios: ``none``; ``transient`` (each worker stalls for 2x a step's compute with
probability 0.1 each step); ``persistent`` (the last worker computes 2x longer every
step); ``slowlink`` (the last worker host's link at a quarter of the others').

Columns: rank 0's step time (median, p99), samples/s of the job (every worker's batches
over the slowest worker's wall time), throughput against ``sync`` in the same scenario,
rank 0's final test accuracy and training seconds until it first reached ``--target``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
from collections.abc import Sequence

from bpstrain.bench import _jobs, emulated
from bpstrain.bench._hosts import EmulatedHosts, LoopbackHosts

_WORKER = "bpstrain.bench._straggler_worker"
_TF_WORKER = "bpstrain.bench._tf_ps_worker"
TF_PS = "tf-ps"  # the peer: TensorFlow's ParameterServerStrategy (asynchronous)
SCENARIOS = ("none", "transient", "persistent", "slowlink")


@dataclasses.dataclass
class StragglerPlan:
    """What one run measures."""

    scenarios: Sequence[str] = ("none", "transient", "persistent", "slowlink")
    systems: Sequence[str] = ("sync", "k:3")
    hosts: int = 4
    servers: int = 2
    rate_mbit: float = 800.0
    steps: int = 200
    batch_size: int = 32
    hidden: int = 256
    compute_ms: float = 40.0
    pad_mbytes: float = 0.0  # extra gradient bytes a step, so that the links matter
    target: float = 0.90
    eval_every: int = 10
    seed: int = 0
    loopback: bool = False
    timeout_s: float = 600.0


@dataclasses.dataclass
class StragglerRow:
    scenario: str
    system: str
    step_median_s: float
    step_p99_s: float | None  # None: only the mean step is known (tf-ps)
    samples_per_s: float
    accuracy: float
    time_to_target_s: float | None
    late_partitions: int  # summed over the workers: pushes that did not count
    max_staleness: int = 0  # ssp/async: the stalest answer any worker got
    vs_sync: float | None = None


def system_env(system: str) -> dict:
    """The environment that selects ``system`` for a bpstrain job."""
    if system == "sync":
        return {"BPSTRAIN_AGGREGATE": "all"}
    if re.fullmatch(r"k:\d+", system):
        return {"BPSTRAIN_AGGREGATE": system}
    if system == "async" or re.fullmatch(r"ssp:\d+", system):
        return {"BPSTRAIN_CONSISTENCY": system}
    if system == TF_PS:
        return {}  # not a bpstrain job
    raise ValueError(f"Expected a system 'sync', 'k:<K>', 'ssp:<s>', 'async' or '{TF_PS}'. "
                     f"Received: {system!r}")


def _p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def _row(scenario: str, system: str, payloads: list[dict], target: float) -> StragglerRow:
    results = [p["results"][0] for p in payloads]
    times = results[0]["times"]
    samples = sum(len(r["times"]) * r["batch"] for r in results)
    curve = results[0]["curve"]
    reached = [t for _, t, acc in curve if acc >= target]
    p99 = None if results[0].get("mean_step_only") else _p99(times)
    return StragglerRow(scenario, system, statistics.median(times), p99,
                        samples / max(r["wall"] for r in results), curve[-1][2] if curve else 0.0,
                        reached[0] if reached else None, sum(r["late"] for r in results),
                        max(r.get("staleness", 0) for r in results))


def _worker_argv(plan: StragglerPlan, scenario: str, module: str = _WORKER) -> list[str]:
    straggle = "none" if scenario in ("none", "slowlink") else scenario
    return [sys.executable, "-m", module, "--steps", str(plan.steps), "--batch-size",
            str(plan.batch_size), "--hidden", str(plan.hidden), "--compute-ms",
            str(plan.compute_ms), "--straggle", straggle, "--slow-rank", str(plan.hosts - 1),
            "--eval-every", str(plan.eval_every), "--seed", str(plan.seed),
            "--pad-mbytes", str(plan.pad_mbytes)]


def run_tf_ps(hosts, layout: _jobs.Layout, argv: Sequence[str], timeout_s: float) -> list[dict]:
    """One ParameterServerStrategy job on ``layout``'s hosts; returns the chief's payload."""
    import json
    import tempfile

    def endpoints(host_list):
        return [f"{hosts.addr(h)}:{hosts.next_port()}" for h in host_list]

    cluster = {"chief": endpoints([layout.scheduler_host]), "worker": endpoints(layout.worker_hosts),
               "ps": endpoints(layout.server_hosts)}
    placement = [("ps", j, h) for j, h in enumerate(layout.server_hosts)]
    placement += [("worker", i, h) for i, h in enumerate(layout.worker_hosts)]
    with tempfile.TemporaryDirectory(prefix="bpstrain-tfps-") as tmp:
        done = ["--done-file", f"{tmp}/done"]
        job = _jobs.Job(hosts)
        env = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
        for kind, index, host in placement:
            config = json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})
            job.start(f"tf-{kind}{index}", host, [*argv, *done], _jobs.child_env({**env, "TF_CONFIG": config}))
        config = json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}})
        job.start("tf-chief", layout.scheduler_host, [*argv, *done],
                  _jobs.child_env({**env, "TF_CONFIG": config}), worker=True)
        return job.collect(timeout_s)


def run(plan: StragglerPlan, log=None) -> list[StragglerRow]:
    """Runs every (scenario, system) job, each scenario on freshly built hosts."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    for scenario in plan.scenarios:
        if scenario not in SCENARIOS:
            raise ValueError(f"Expected scenarios among {', '.join(SCENARIOS)}. Received: {scenario!r}")
    for system in plan.systems:
        system_env(system)  # a bad name fails before any job starts
    layout = _jobs.Layout(worker_hosts=list(range(plan.hosts)),
                          server_hosts=[0 if plan.loopback else plan.hosts + j for j in range(plan.servers)],
                          scheduler_host=0 if plan.loopback else plan.hosts + plan.servers)
    rows: list[StragglerRow] = []
    for scenario in plan.scenarios:
        cluster = None
        if plan.loopback:
            hosts = LoopbackHosts()
        else:
            rates = [plan.rate_mbit] * (plan.hosts + plan.servers + 1)
            if scenario == "slowlink":
                rates[plan.hosts - 1] = plan.rate_mbit / 4
            cluster = emulated.EmulatedCluster(len(rates), rates)
            hosts = EmulatedHosts(cluster)
        try:
            for system in plan.systems:
                log(f"[stragglers] {scenario}: {system}, {plan.hosts} worker hosts, "
                    f"{plan.servers} server hosts")
                if system == TF_PS:
                    payloads = run_tf_ps(hosts, layout, _worker_argv(plan, scenario, _TF_WORKER),
                                         plan.timeout_s)
                    rows.append(_row(scenario, system, payloads, plan.target))
                    continue
                env = {**system_env(system), "BPSTRAIN_OP_TIMEOUT": str(int(plan.timeout_s))}
                argv = _worker_argv(plan, scenario)
                if system.startswith("k:"):
                    argv.append("--catch-up")  # a slow worker skips ahead (DistributedOptimizer catch_up)
                payloads = _jobs.run_ps_job(hosts, layout, argv, plan.timeout_s, env)
                rows.append(_row(scenario, system, payloads, plan.target))
        finally:
            if cluster is not None:
                cluster.close()
    for row in rows:
        sync = [r for r in rows if r.scenario == row.scenario and r.system == "sync"]
        if sync:
            row.vs_sync = row.samples_per_s / sync[0].samples_per_s
    return rows


def format_table(rows: Sequence[StragglerRow], target: float) -> str:
    """The result table (one line per scenario and system)."""
    head = (f"{'scenario':<11} {'system':<7} {'step med':>9} {'step p99':>9} {'samples/s':>10} "
            f"{'vs sync':>8} {'accuracy':>9} {f'to {target:.0%}':>8} {'late':>6} {'stale':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        tta = f"{r.time_to_target_s:.1f} s" if r.time_to_target_s is not None else "-"
        vs = f"{r.vs_sync:.2f}x" if r.vs_sync is not None else "-"
        p99 = f"{r.step_p99_s * 1e3:>6.1f} ms" if r.step_p99_s is not None else f"{'-':>9}"
        lines.append(f"{r.scenario:<11} {r.system:<7} {r.step_median_s * 1e3:>6.1f} ms "
                     f"{p99} {r.samples_per_s:>10.1f} {vs:>8} "
                     f"{r.accuracy:>9.4f} {tta:>8} {r.late_partitions:>6} {r.max_staleness:>5}")
    return "\n".join(lines)


def needs_root(args: argparse.Namespace) -> bool:
    """Whether these flags build emulated hosts."""
    return not args.loopback


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this benchmark's flags (used by ``bpstrain.bench.cli``)."""
    parser.add_argument("--scenarios", nargs="+", default=list(StragglerPlan.scenarios),
                        choices=SCENARIOS)
    parser.add_argument("--systems", nargs="+", default=list(StragglerPlan.systems),
                        help="sync, k:<K> (k-of-n aggregation), ssp:<s>, async, tf-ps (TensorFlow's "
                             "ParameterServerStrategy)")
    parser.add_argument("--hosts", type=int, default=4, help="worker hosts (one worker each)")
    parser.add_argument("--servers", type=int, default=2, help="server hosts")
    parser.add_argument("--rate-mbit", type=float, default=800.0, help="per-host link cap")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--compute-ms", type=float, default=40.0,
                        help="emulated compute per step (a sleep, besides the real model)")
    parser.add_argument("--pad-mbytes", type=float, default=0.0,
                        help="extra gradient MB a step (a padding parameter): a communication-heavy model")
    parser.add_argument("--target", type=float, default=0.90, help="test accuracy to time")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loopback", action="store_true", help="no namespaces, no caps (no root)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")


def run_args(args: argparse.Namespace) -> tuple[str, str, list[dict]]:
    """Runs the benchmark for parsed flags; returns ``(title, table, json records)``."""
    plan = StragglerPlan(scenarios=args.scenarios, systems=args.systems, hosts=args.hosts,
                         servers=args.servers, rate_mbit=args.rate_mbit, steps=args.steps,
                         batch_size=args.batch_size, compute_ms=args.compute_ms,
                         pad_mbytes=args.pad_mbytes,
                         target=args.target, eval_every=args.eval_every, seed=args.seed,
                         loopback=args.loopback, timeout_s=args.timeout)
    rows = run(plan)
    where = "loopback" if plan.loopback else f"{plan.rate_mbit:g} Mbit/s per host"
    title = (f"stragglers: {plan.hosts} workers, {plan.servers} servers, {where}, "
             f"{plan.steps} steps of digits_mlp, {plan.compute_ms:g} ms compute a step"
             + (f", {plan.pad_mbytes:g} MB of extra gradients" if plan.pad_mbytes else ""))
    return title, format_table(rows, plan.target), [dataclasses.asdict(r) for r in rows]


def main(argv: list[str] | None = None) -> int:
    """``python -m bpstrain.bench.stragglers``: same as ``python -m bpstrain.bench stragglers``."""
    from bpstrain.bench import cli

    return cli.main(["stragglers", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
