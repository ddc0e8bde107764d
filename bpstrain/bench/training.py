"""Training throughput on emulated hosts: bpstrain DistributedOptimizer vs torch DDP (gloo).

System ``bpstrain-cb`` is bpstrain with :func:`bpstrain.torch.CrossBarrier` (the next
forward overlaps the last gradients' communication); ``ddp-bpstrain`` is unmodified torch
DDP over the ``torch.distributed`` backend "bpstrain" (the same job as ``bpstrain``:
scheduler, servers, workers), ``ddp`` the same DDP over gloo, ``alone`` one process on
worker host 0 with no communication (a step's compute time).

    python -m bpstrain.bench.training --model vgg16 --hosts 4 --servers 4 --rate-mbit 800
    python -m bpstrain.bench.training --model vgg16 resnet50 --iters 3 --json out.json
    python -m bpstrain.bench.training --loopback --model resnet50 --hosts 2 --servers 1
    python -m bpstrain.bench.training --model vgg16 --systems ddp-bpstrain ddp
    python -m bpstrain.bench.training --model resnet50 --trace traces   # where workers wait

Layout: worker hosts 0..H-1 (bpstrain workers and gloo ranks alike), server hosts
H..H+K-1, the scheduler on host H+K; every host's upload and download are capped at
``--rate-mbit`` (root needed, see :mod:`bpstrain.bench.emulated`). Both systems train
the same model on the same synthetic batch with plain SGD, one job after the other on
the same hosts. Small images (``--image-size 32``) keep the CPU work small, so VGG-16
(138M parameters) is communication bound. Progress goes to stderr, the table last to
stdout. The "comm bound" column is the bandwidth bound of one step's gradient
exchange (PS: max(M/B, n·M/(k·B)); ring all-reduce: 2(n-1)/n·M/B).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from bpstrain.bench import _jobs, bounds, emulated
from bpstrain.bench._hosts import EmulatedHosts, LoopbackHosts

_WORKER = "bpstrain.bench._train_worker"


@dataclasses.dataclass
class TrainPlan:
    """What one run measures."""

    models: Sequence[str] = ("vgg16", "resnet50")
    hosts: int = 4
    servers: int = 4
    rate_mbit: float = 800.0
    batch_size: int = 8
    image_size: int = 32
    num_classes: int = 1000
    iters: int = 3
    warmup: int = 1
    fp16: bool = False
    device: str = "cpu"
    systems: Sequence[str] = ("bpstrain", "ddp")
    latency_ms: float = 20.0
    loopback: bool = False
    timeout_s: float = 900.0
    trace_dir: str | None = None  # bpstrain systems: a Chrome trace of the last step here
    mixed: bool = False  # a server on every worker host too (mixed mode), besides the server hosts


@dataclasses.dataclass
class TrainRow:
    """One (model, system) result; ``step_s`` is the mean of the slowest rank's steps."""

    model: str
    system: str
    workers: int
    servers: int | None
    batch: int
    step_s: float
    samples_per_s: float
    bound_s: float
    vs_ddp: float | None = None


def _worker_args(plan: TrainPlan, model: str) -> list[str]:
    argv = ["--model", model, "--batch-size", str(plan.batch_size), "--image-size",
            str(plan.image_size), "--num-classes", str(plan.num_classes), "--iters",
            str(plan.iters), "--warmup", str(plan.warmup), "--device", plan.device]
    return argv + (["--fp16"] if plan.fp16 else [])


def _run_bpstrain(hosts, plan: TrainPlan, model: str, system: str = "bpstrain") -> list[dict]:
    """A bpstrain job (``system``: bpstrain, bpstrain-cb or ddp-bpstrain)."""
    layout = ps_layout(plan.hosts, plan.servers, plan.loopback, plan.mixed)
    worker_system = "bpstrain" if system == "bpstrain-cb" else system
    argv = [sys.executable, "-m", _WORKER, "--system", worker_system, *_worker_args(plan, model)]
    argv += ["--cross-barrier"] if system == "bpstrain-cb" else []
    prefix = None
    if plan.trace_dir and worker_system == "bpstrain":
        prefix = str(Path(plan.trace_dir).resolve() / f"{model}-{system}")
        argv += ["--trace", prefix]
    payloads = _jobs.run_ps_job(hosts, layout, argv, plan.timeout_s,
                                {"BPSTRAIN_TIMEOUT": "60", "BPSTRAIN_OP_TIMEOUT": str(int(plan.timeout_s))})
    if prefix is not None:
        _merge_trace(prefix, plan.hosts)
    return payloads


def _merge_trace(prefix: str, workers: int, log=None) -> None:
    """Merges the ranks' traces into ``<prefix>.json`` and logs each rank's summary."""
    from bpstrain.bench._step_trace import summary
    from bpstrain.trainer.callbacks.timeline import merge_traces

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    found = [Path(f"{prefix}.rank{r}.json") for r in range(workers)]
    found = [p for p in found if p.is_file()]
    for path in found:
        line = summary(json.loads(path.read_text()))
        if line:
            log(f"[training]   {line}")
    if found:
        merge_traces(found, f"{prefix}.json")
        for path in found:
            path.unlink()
        log(f"[training]   trace of the last step: {prefix}.json")


def _run_ddp(hosts, plan: TrainPlan, model: str) -> list[dict]:
    argv = [sys.executable, "-m", _WORKER, "--system", "ddp", *_worker_args(plan, model)]
    return run_ddp_job(hosts, plan.hosts, argv, plan.timeout_s)


def run_ddp_job(hosts, world_size: int, argv: Sequence[str], timeout_s: float,
                op_timeout_s: float | None = None) -> list[dict]:
    """Rank r of a gloo job on worker host r: ``argv`` plus the rendezvous flags ``--addr``
    (host 0), ``--port``, ``--world-size``, ``--ifname``, ``--timeout`` (gloo's,
    ``op_timeout_s`` or the job's deadline ``timeout_s``) and ``--rank``; returns the
    ranks' ``BENCH_RESULT`` payloads (see :class:`bpstrain.bench._jobs.Job`)."""
    argv = [*argv, "--addr", hosts.addr(0), "--port", str(hosts.next_port()), "--world-size",
            str(world_size), "--ifname", hosts.ifname, "--timeout", str(op_timeout_s or timeout_s)]
    job = _jobs.Job(hosts)
    for rank in range(world_size):
        job.start(f"ddp{rank}", rank, [*argv, "--rank", str(rank)], _jobs.child_env({}),
                  worker=True)
    return job.collect(timeout_s)


def ps_layout(hosts: int, servers: int, loopback: bool, mixed: bool = False) -> _jobs.Layout:
    """This benchmark's bpstrain layout: workers on hosts 0..H-1, servers on H..H+K-1 and
    the scheduler on H+K (on loopback every number is this machine); ``mixed`` puts one
    more server on every worker host."""
    return _jobs.Layout(worker_hosts=list(range(hosts)),
                        server_hosts=[j if loopback else hosts + j for j in range(servers)],
                        scheduler_host=0 if loopback else hosts + servers, colocated=mixed)


def _run_alone(hosts, plan: TrainPlan, model: str) -> list[dict]:
    """One process on worker host 0, no communication: the compute part of a step."""
    argv = [sys.executable, "-m", _WORKER, "--system", "alone", *_worker_args(plan, model)]
    job = _jobs.Job(hosts)
    job.start("alone", 0, argv, _jobs.child_env({}), worker=True)
    return job.collect(plan.timeout_s)


def _param_bytes(model: str, num_classes: int) -> int:
    from bpstrain.models import get_model

    return sum(p.numel() * 4 for p in get_model(model, num_classes=num_classes).parameters())


def _step_time(payloads: list[dict]) -> float:
    per_rank = [p["results"][0]["times"] for p in payloads]
    slowest = [max(ts) for ts in zip(*per_rank)]
    return sum(slowest) / len(slowest)


def run(plan: TrainPlan, log=None) -> list[TrainRow]:
    """Builds the hosts, runs every (model, system) job, tears down; returns the rows."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    link = bounds.link_bytes_per_s(plan.rate_mbit)
    cluster = None
    if plan.loopback:
        hosts = LoopbackHosts()
    else:
        cluster = emulated.EmulatedCluster(plan.hosts + plan.servers + 1, plan.rate_mbit,
                                           latency_ms=plan.latency_ms)
        hosts = EmulatedHosts(cluster)
    rows: list[TrainRow] = []
    try:
        for model in plan.models:
            nbytes = _param_bytes(model, plan.num_classes) // (2 if plan.fp16 else 1)
            for system in plan.systems:
                log(f"[training] {model}: {system}, {plan.hosts} worker hosts"
                    + (f", {plan.servers} server hosts" if system != "ddp" else ""))
                if system == "ddp":
                    payloads = _run_ddp(hosts, plan, model)
                elif system == "alone":
                    payloads = _run_alone(hosts, plan, model)
                else:
                    payloads = _run_bpstrain(hosts, plan, model, system)
                step = _step_time(payloads)
                phases = payloads[0]["results"][0].get("phases") or [[0.0] * 4]
                mean = [sum(col) / len(col) for col in zip(*phases)]
                log(f"[training]   rank 0 per step: forward {mean[0]:.2f} s, backward "
                    f"{mean[1]:.2f} s, gradient wait {mean[2]:.2f} s, update {mean[3]:.2f} s")
                workers = 1 if system == "alone" else plan.hosts
                bound = (0.0 if system == "alone"
                         else bounds.ring_bound_s(nbytes, plan.hosts, link) if system == "ddp"
                         else bounds.mixed_bound_s(nbytes, plan.hosts, plan.servers, link) if plan.mixed
                         else bounds.ps_bound_s(nbytes, plan.hosts, plan.servers, link))
                rows.append(TrainRow(model, system, workers,
                                     plan.servers if system not in ("ddp", "alone") else None,
                                     plan.batch_size, step, workers * plan.batch_size / step,
                                     bound))
    finally:
        if cluster is not None:
            cluster.close()
    for row in rows:
        ddp = [r for r in rows if r.model == row.model and r.system == "ddp"]
        if ddp and row.system != "alone":
            row.vs_ddp = row.samples_per_s / ddp[0].samples_per_s
    return rows


def format_table(rows: Sequence[TrainRow]) -> str:
    """A fixed-width table, one line per row."""
    head = f"{'model':<10} {'system':<12} {'n':>2} {'k':>2} {'batch':>5} {'step s':>8} " \
           f"{'samples/s':>10} {'comm bound s':>12} {'vs DDP':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        vs = f"{r.vs_ddp:.2f}x" if r.vs_ddp is not None else "-"
        lines.append(f"{r.model:<10} {r.system:<12} {r.workers:>2} {r.servers or '-':>2} "
                     f"{r.batch:>5} {r.step_s:>8.2f} {r.samples_per_s:>10.2f} {r.bound_s:>12.2f} "
                     f"{vs:>7}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Command line; see the module docstring. Exit 1 on a failed job, 2 without root."""
    p = argparse.ArgumentParser(prog="python -m bpstrain.bench.training",
                                description="Training samples/s: bpstrain vs torch DDP (gloo).")
    p.add_argument("--model", nargs="+", default=["vgg16", "resnet50"], dest="models")
    p.add_argument("--hosts", type=int, default=4, help="worker hosts (one worker each)")
    p.add_argument("--servers", type=int, default=4, help="bpstrain server hosts")
    p.add_argument("--mixed", action="store_true",
                   help="also a server on every worker host (mixed mode; --servers 0 is allowed)")
    p.add_argument("--rate-mbit", type=float, default=800.0, help="per-host link cap")
    p.add_argument("--batch-size", type=int, default=8, help="per worker")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--iters", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--fp16", action="store_true", help="float16 gradients (both systems)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where every worker trains (cuda: the emulated hosts share the GPU; "
                        "DDP's gloo then reduces CUDA tensors)")
    p.add_argument("--systems", nargs="+",
                   choices=["bpstrain", "bpstrain-cb", "ddp-bpstrain", "ddp", "alone"],
                   default=["bpstrain", "ddp"])
    p.add_argument("--loopback", action="store_true", help="no namespaces, no caps (no root needed)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--trace", metavar="DIR",
                   help="bpstrain systems: write DIR/<model>-<system>.json, a Chrome trace of "
                        "the last step of every worker, and log where each worker waited")
    args = p.parse_args(argv)
    if not args.loopback:
        ok, reason = emulated.available()
        if not ok:
            print(f"bpstrain.bench.training: {reason}; use --loopback.", file=sys.stderr)
            return 2
    plan = TrainPlan(models=args.models, hosts=args.hosts, servers=args.servers,
                     rate_mbit=args.rate_mbit, batch_size=args.batch_size,
                     image_size=args.image_size, num_classes=args.num_classes, iters=args.iters,
                     warmup=args.warmup, fp16=args.fp16, device=args.device, systems=args.systems,
                     loopback=args.loopback, timeout_s=args.timeout, trace_dir=args.trace,
                     mixed=args.mixed)
    try:
        rows = run(plan)
    except (_jobs.BenchError, ValueError) as exc:
        print(f"bpstrain.bench.training: {exc}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump([dataclasses.asdict(r) for r in rows], handle, indent=2)
    where = "loopback (no caps)" if plan.loopback else f"emulated hosts, {plan.rate_mbit:g} Mbit/s"
    print(f"training throughput, {where}, {plan.image_size}x{plan.image_size} synthetic images")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
