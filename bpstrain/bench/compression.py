"""Gradient compression: step time, bytes on the wire, accuracy, time to accuracy and
codec throughput of bpstrain's compressors against torch DDP's communication hooks::

    python -m bpstrain.bench compression --rate-mbit 100 800           # every part (root)
    python -m bpstrain.bench compression --part wire --rate-mbit 100 --iters 3
    python -m bpstrain.bench compression --part accuracy --acc-steps 300 --tta-target 0.95
    python -m bpstrain.bench compression --part kernels --kernel-mbytes 64
    python -m bpstrain.bench compression --loopback --hosts 2 --servers 1 --iters 1 \
        --model digits_mlp --systems none onebit ddp-fp16 --acc-systems none topk \
        --tta-systems onebit --acc-steps 4 --tta-steps 4 --kernel-mbytes 1   # smoke, no root

Parts (``--part``, several allowed; default all three):

* **wire**: on emulated hosts (``--hosts`` worker hosts, ``--servers`` server hosts, the
  scheduler on a host of its own, every link capped at each ``--rate-mbit`` with ``tc
  tbf``; see :mod:`bpstrain.bench.training`), the training benchmark's step (VGG-16,
  32×32 synthetic images, batch 8 per worker, plain SGD) for each system: the median
  over ``--iters`` steps of the slowest worker's step time, and the bytes the worker
  hosts' links carried per step (each worker reads its namespace's interface counters,
  ``/proc/net/dev``, right before and after its timed steps; tx + rx summed over the
  worker hosts, divided by the steps). "vs none" and "vs DDP+fp16" are that system's
  step time divided into bpstrain-none's and DDP+fp16's of the same run.
* **accuracy**: ``--acc-steps`` SGD steps of ``digits_cnn`` on ``--hosts`` workers (each
  its shard of sklearn's digits), then the test accuracy; plus **time to accuracy** at
  ``--tta-rate-mbit`` (100) with a communication-heavy model, ``digits_mlp`` with
  ``--tta-hidden`` (4096) hidden units: training seconds until the test accuracy first
  reaches ``--tta-target`` (evaluated every ``--eval-every`` steps, off the clock).
* **kernels**: compress + decompress throughput of the torch compressors' codecs on a
  ``--kernel-mbytes`` fp32 tensor (CPU, and CUDA when available), and of the servers'
  codec (``bpstrain._core.CompressedRounds``: decode ``--kernel-workers`` pushes, sum,
  re-encode), in GB/s of dense fp32 input; torch on ``--kernel-threads`` threads.

Systems: ``none fp16 bf16 onebit topk randomk dithering powersgd`` are bpstrain's
``DistributedOptimizer(compression=Compression.<name>(...))`` (top-k/random-k ratio,
dithering levels and PowerSGD rank from the flags), ``auto`` is ``--auto-spec``
(``auto:onebit``: compression only where it pays; not in the default lists); ``ddp``, ``ddp-fp16``,
``ddp-powersgd`` and ``ddp-powersgd-batched`` are torch DDP over gloo with no hook,
``fp16_compress_hook``, ``powerSGD_hook`` and ``batched_powerSGD_hook`` (PowerSGD from
step 2; with torch 2.13 on gloo these crash: a job that fails is reported as
"crashed: <first error line>" in its row, and the run goes on). ``--loopback`` runs
every process on this machine with no caps (no root; the byte counts are then all of
``lo``'s traffic seen by worker 0, not per link).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
import time
from collections.abc import Sequence

from bpstrain.bench import _jobs, emulated
from bpstrain.bench._compress_worker import MOMENTUM, STEPS_DONE
from bpstrain.bench._hosts import EmulatedHosts, LoopbackHosts
from bpstrain.bench.training import ps_layout, run_ddp_job

_WORKER = "bpstrain.bench._compress_worker"
PARTS = ("wire", "accuracy", "kernels")
# topk-mc: top-k with DGC's momentum correction (for the accuracy part, whose SGD has
# momentum; the wire part's plain SGD refuses it).
BPSTRAIN_SYSTEMS = ("none", "fp16", "bf16", "onebit", "topk", "randomk", "topk-mc",
                    "dithering", "powersgd", "auto")
DDP_SYSTEMS = ("ddp", "ddp-fp16", "ddp-bf16", "ddp-powersgd", "ddp-powersgd-batched")
SYSTEMS = BPSTRAIN_SYSTEMS + DDP_SYSTEMS
WIRE_SYSTEMS = ("none", "fp16", "onebit", "topk", "randomk", "powersgd", "dithering",
                "ddp", "ddp-fp16", "ddp-powersgd")
ACC_SYSTEMS = ("none", "fp16", "onebit", "topk", "randomk", "topk-mc", "powersgd",
               "dithering", "ddp-fp16")
TTA_SYSTEMS = ("none", "onebit", "topk", "topk-mc", "ddp-fp16")
KERNEL_CODECS = ("fp16", "bf16", "onebit", "topk", "randomk", "dithering", "powersgd")
SERVER_CODECS = ("onebit", "topk", "dithering")


@dataclasses.dataclass
class CompressionPlan:
    """What one run measures (see the module docstring)."""

    parts: Sequence[str] = PARTS
    rates_mbit: Sequence[float] = (100.0, 800.0)
    hosts: int = 4
    servers: int = 4
    systems: Sequence[str] = WIRE_SYSTEMS
    topk_ratio: float = 0.01
    randomk_ratio: float = 0.01
    powersgd_rank: int = 2
    dithering_levels: int = 15
    auto_spec: str = "auto:onebit"
    # wire
    model: str = "vgg16"
    batch_size: int = 8
    image_size: int = 32
    num_classes: int = 1000
    iters: int = 3
    warmup: int = 2
    device: str = "cpu"
    # accuracy and time to accuracy
    acc_systems: Sequence[str] = ACC_SYSTEMS
    acc_model: str = "digits_cnn"
    acc_steps: int = 300
    acc_seeds: int = 1
    acc_batch: int = 32
    lr: float = 0.05
    eval_every: int = 10
    tta_systems: Sequence[str] = TTA_SYSTEMS
    tta_rate_mbit: float = 100.0
    tta_hidden: int = 4096
    tta_steps: int = 300
    tta_target: float = 0.95
    # kernels
    kernel_mbytes: float = 64.0
    kernel_repeat: int = 3
    kernel_workers: int = 4
    kernel_threads: int = 1
    kernel_devices: Sequence[str] = ("cpu", "cuda")
    # where
    loopback: bool = False
    latency_ms: float = 20.0
    timeout_s: float = 1800.0
    hook_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        unknown = [p for p in self.parts if p not in PARTS]
        bad = [s for s in (*self.systems, *self.acc_systems, *self.tta_systems) if s not in SYSTEMS]
        if unknown or bad or self.hosts < 1 or self.servers < 1 or not self.rates_mbit:
            raise ValueError(f"Expected parts of {PARTS}, systems of {SYSTEMS}, hosts and servers "
                             f">= 1 and a rate. Received: parts={list(self.parts)}, unknown "
                             f"systems={bad}, hosts={self.hosts}, servers={self.servers}")

    def spec(self, system: str) -> str:
        """The worker's ``--compression`` of a system: a bpstrain spec or a DDP hook."""
        if system in DDP_SYSTEMS:
            return "none" if system == "ddp" else system[len("ddp-"):]
        mc = f":momentum={MOMENTUM:g}"
        return {"topk": f"topk:{self.topk_ratio:g}", "randomk": f"randomk:{self.randomk_ratio:g}",
                "topk-mc": f"topk:{self.topk_ratio:g}{mc}",
                "dithering": f"dithering:{self.dithering_levels}",
                "powersgd": f"powersgd:{self.powersgd_rank}",
                "auto": self.auto_spec}.get(system, system)

    def label(self, system: str) -> str:
        """The system as the tables name it."""
        names = {"ddp": "DDP (gloo)", "ddp-fp16": "DDP + fp16 hook", "ddp-bf16": "DDP + bf16 hook",
                 "ddp-powersgd": f"DDP + PowerSGD hook (rank {self.powersgd_rank})",
                 "ddp-powersgd-batched": f"DDP + batched PowerSGD hook (rank {self.powersgd_rank})",
                 "topk": f"bpstrain top-k {self.topk_ratio * 100:g}%",
                 "randomk": f"bpstrain random-k {self.randomk_ratio * 100:g}%",
                 "topk-mc": f"bpstrain top-k {self.topk_ratio * 100:g}% + momentum correction",
                 "dithering": f"bpstrain dithering {self.dithering_levels} levels",
                 "powersgd": f"bpstrain PowerSGD rank {self.powersgd_rank}",
                 "auto": f"bpstrain {self.auto_spec}"}
        return names.get(system, f"bpstrain {system}")


@dataclasses.dataclass
class WireRow:
    """One system at one rate: median step time and bytes on the worker links per step."""

    system: str
    label: str
    rate_mbit: float | None
    step_s: float | None
    wire_bytes_per_step: float | None
    outcome: str = "ok"
    vs_none: float | None = None
    vs_ddp_fp16: float | None = None
    bytes_vs_none: float | None = None
    part: str = "wire"


@dataclasses.dataclass
class AccuracyRow:
    """Test accuracy after ``steps`` steps; for time to accuracy also the time to target."""

    system: str
    label: str
    model: str
    steps: int
    accuracy: float | None
    rate_mbit: float | None = None
    points_vs_none: float | None = None
    target: float | None = None
    steps_to_target: int | None = None
    time_to_target_s: float | None = None
    step_s: float | None = None
    vs_ddp_fp16: float | None = None
    outcome: str = "ok"
    part: str = "accuracy"
    seed_accuracies: list | None = None  # one per seed; ``accuracy`` is their mean


@dataclasses.dataclass
class KernelRow:
    """Throughput of one codec in GB/s of dense fp32 input."""

    codec: str
    where: str
    gb_per_s: float | None
    outcome: str = "ok"
    part: str = "kernels"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def first_error_line(text: str) -> str:
    """The line of a failed job's message that names the error (an exception, a C++
    abort, an assertion), else its first line; at most 160 characters. torch's
    ``[rankN]:`` prefixes are dropped, and a bare exception name (``AssertionError``)
    gets the function it was raised in."""
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("---")]
    for i, line in enumerate(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line):
            # torch chains future callbacks' errors into one line; C++ paths to file names
            line = re.sub(r"(Got the following error when running the callback: "
                          r"(\w+Error: )?)+", "", line)
            line = re.sub(r"\[/[^\]]*/([^/\]]+)\]", r"[\1]", line)
            if ":" not in line:
                where = next((m for m in (re.match(r'File "([^"]+)", line (\d+), in (\S+)', prev)
                                          for prev in reversed(lines[:i])) if m), None)
                if where:
                    line += f" in {where[3]} ({where[1].rsplit('/', 1)[-1]}:{where[2]})"
            return line[:160]
    for line in lines:
        if re.search(r"terminate called|what\(\)|enforce fail|Assertion|Abort|Segmentation|"
                     r"Fatal", line):
            return line[:160]
    return (lines[0] if lines else "no output")[:160]


def _outcome(exc: Exception) -> str:
    text = str(exc)
    if "did not finish" in text:
        return "timed out: " + first_error_line(text.split("Received:", 1)[-1])
    when = "crashed at exit, after its steps: " if STEPS_DONE in text else "crashed: "
    return when + first_error_line(text.split("\n", 1)[-1] if "\n" in text else text)


def _run_job(hosts, plan: CompressionPlan, system: str, args: list[str], timeout_s: float
             ) -> list[dict]:
    """One job of ``system`` running the worker with ``args``; the workers' payloads."""
    argv = [sys.executable, "-m", _WORKER, "--system", "ddp" if system in DDP_SYSTEMS else "bpstrain",
            "--compression", plan.spec(system), "--powersgd-rank", str(plan.powersgd_rank), *args]
    if system in DDP_SYSTEMS:  # adds --ifname and --timeout
        share = 2
        if "powersgd" in system:  # known to crash or hang on gloo: a shorter deadline
            timeout_s, share = min(timeout_s, plan.hook_timeout_s), 4
        # gloo's own timeout first (a hook may wait on several chained collectives), so a
        # hung collective ends with gloo's error message, not with the job's deadline
        return run_ddp_job(hosts, plan.hosts, argv, timeout_s, op_timeout_s=timeout_s / share)
    argv += ["--ifname", hosts.ifname, "--timeout", str(timeout_s)]
    return _jobs.run_ps_job(hosts, ps_layout(plan.hosts, plan.servers, plan.loopback), argv,
                            timeout_s, {"BPSTRAIN_OP_TIMEOUT": str(int(timeout_s))})


def _wire_bytes(payloads: list[dict], loopback: bool) -> float:
    res = [p["results"][0] for p in payloads]
    steps = max(1, len(res[0]["times"]))
    if loopback:  # every process shares lo: worker 0 saw all of it (tx = rx there)
        return res[0]["tx"] / steps
    return sum(r["tx"] + r["rx"] for r in res) / steps


def _median_step(payloads: list[dict]) -> float:
    per_rank = [p["results"][0]["times"] for p in payloads]
    return statistics.median(max(ts) for ts in zip(*per_rank))


def run_wire(hosts, plan: CompressionPlan, rate: float | None) -> list[WireRow]:
    """Every system's training step on ``hosts`` (capped at ``rate``)."""
    rows = []
    args = ["--task", "wire", "--model", plan.model, "--batch-size", str(plan.batch_size),
            "--image-size", str(plan.image_size), "--num-classes", str(plan.num_classes),
            "--iters", str(plan.iters), "--warmup", str(plan.warmup), "--device", plan.device]
    for system in plan.systems:
        _log(f"[compression] wire, {'loopback' if rate is None else f'{rate:g} Mbit/s'}: "
             f"{plan.label(system)}")
        row = WireRow(system, plan.label(system), rate, None, None)
        try:
            payloads = _run_job(hosts, plan, system, args, plan.timeout_s)
            row.step_s = _median_step(payloads)
            row.wire_bytes_per_step = _wire_bytes(payloads, plan.loopback)
            _log(f"[compression]   {row.step_s:.3f} s/step, "
                 f"{row.wire_bytes_per_step / 1e6:.2f} MB/step on the worker links")
        except _jobs.BenchError as exc:
            row.outcome = _outcome(exc)
            _log(f"[compression]   {row.outcome}")
        rows.append(row)
    none = next((r for r in rows if r.system == "none" and r.step_s), None)
    fp16 = next((r for r in rows if r.system == "ddp-fp16" and r.step_s), None)
    for r in rows:
        if r.step_s:
            r.vs_none = none.step_s / r.step_s if none else None
            r.vs_ddp_fp16 = fp16.step_s / r.step_s if fp16 else None
            if none and r.wire_bytes_per_step:
                r.bytes_vs_none = none.wire_bytes_per_step / r.wire_bytes_per_step
    return rows


def _train(hosts, plan: CompressionPlan, systems: Sequence[str], model_args: list[str],
           model: str, steps: int, rate: float | None, target: float | None,
           seeds: int = 1) -> list[AccuracyRow]:
    """Each system's job, once per seed (0 .. seeds-1: initial weights and batches); the
    accuracy is the seeds' mean, the step time and time to target the first seed's."""
    rows = []
    args = ["--task", "accuracy", *model_args, "--steps", str(steps), "--batch-size",
            str(plan.acc_batch), "--lr", str(plan.lr), "--eval-every", str(plan.eval_every)]
    for system in systems:
        what = "time to accuracy" if target else "accuracy"
        _log(f"[compression] {what}, {model}, {steps} steps: {plan.label(system)}")
        row = AccuracyRow(system, plan.label(system), model, steps, None, rate_mbit=rate,
                          target=target)
        try:
            results = [_run_job(hosts, plan, system, [*args, "--seed", str(seed)],
                                plan.timeout_s)[0]["results"][0] for seed in range(seeds)]
            res = results[0]
            row.seed_accuracies = [r["curve"][-1][2] for r in results]
            row.accuracy = statistics.fmean(row.seed_accuracies)
            row.step_s = statistics.median(res["times"])
            if target is not None:
                hit = next((c for c in res["curve"] if c[2] >= target), None)
                if hit:
                    row.steps_to_target, row.time_to_target_s = hit[0], hit[1]
            _log(f"[compression]   accuracy {row.accuracy:.4f}, {row.step_s:.3f} s/step"
                 + (f", target at {row.time_to_target_s:.2f} s" if row.time_to_target_s else ""))
        except _jobs.BenchError as exc:
            row.outcome = _outcome(exc)
            _log(f"[compression]   {row.outcome}")
        rows.append(row)
    none = next((r for r in rows if r.system == "none" and r.accuracy is not None), None)
    fp16 = next((r for r in rows if r.system == "ddp-fp16" and r.time_to_target_s), None)
    for r in rows:
        if r.accuracy is not None and none:
            r.points_vs_none = 100 * (r.accuracy - none.accuracy)
        if r.time_to_target_s and fp16:
            r.vs_ddp_fp16 = fp16.time_to_target_s / r.time_to_target_s
    return rows


def run_accuracy(hosts, plan: CompressionPlan) -> list[AccuracyRow]:
    """Test accuracy of ``plan.acc_model`` after ``plan.acc_steps`` steps per system."""
    return _train(hosts, plan, plan.acc_systems, ["--model", plan.acc_model], plan.acc_model,
                  plan.acc_steps, None, None, plan.acc_seeds)


def run_tta(hosts, plan: CompressionPlan, rate: float | None) -> list[AccuracyRow]:
    """Time to ``plan.tta_target`` with the wide digits MLP, per system."""
    model = f"digits_mlp(hidden={plan.tta_hidden})"
    return _train(hosts, plan, plan.tta_systems, ["--model", "digits_mlp", "--hidden",
                                                  str(plan.tta_hidden)],
                  model, plan.tta_steps, rate, plan.tta_target)


# -- kernels ------------------------------------------------------------------------------

def _best(fn, repeat: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _torch_codec(codec: str, plan: CompressionPlan, x):
    """A compress + decompress round trip of ``codec`` with the torch compressors' kernels."""
    import torch

    import bpstrain.torch  # noqa: F401 - the package first: its submodules import each other
    from bpstrain import _codec
    from bpstrain._compression import parse_compression

    spec = parse_compression(plan.spec(codec))
    if codec in ("fp16", "bf16"):
        from bpstrain.torch.compression import Compression

        comp = getattr(Compression, codec)
        return lambda: comp.decompress(*comp.compress(x))
    if codec in ("onebit", "topk", "dithering"):
        from bpstrain.torch import _codecs

        if x.device.type == "cpu":  # what the compressors run for CPU tensors: the C++ codec
            def host_codec():
                data, residual = _codecs.encode_host(spec, x, seed=1 if codec == "dithering" else 0)
                return _codecs.check_answer(data, x.numel()), residual
            return host_codec

        def byte_codec():
            u = torch.rand(x.numel(), device=x.device) if codec == "dithering" else None
            data, sent = _codecs.encode(spec, x, u)
            residual = x - sent  # the worker's error feedback
            return _codecs.decode(spec, data, x.numel()), residual
        return byte_codec
    if codec == "randomk":
        n = x.numel()
        k = _codec.topk_count(n, spec.ratio)

        def randomk():
            a, b = _codec.randomk_affine(n, spec.seed, "bench", 0)
            idx = (a + torch.arange(k, device=x.device, dtype=torch.int64) * b) % n
            values = x[idx]
            residual = x.clone()
            residual[idx] = 0
            out = torch.zeros(n, dtype=torch.float32, device=x.device)
            out[idx] = values
            return out, residual
        return randomk
    if codec == "powersgd":
        from bpstrain.torch._compressors import orthogonalize

        rows = 1 << (max(1, x.numel().bit_length() - 1) // 2)
        m = x[:rows * (x.numel() // rows)].reshape(rows, -1)
        q0 = torch.randn(m.shape[1], spec.rank, device=x.device)

        def powersgd():
            p = orthogonalize(m @ q0)
            q = m.t() @ p
            approx = p @ q.t()
            return approx, m - approx
        return powersgd
    raise ValueError(f"Expected a codec of {KERNEL_CODECS}. Received: {codec!r}")


def run_kernels(plan: CompressionPlan) -> list[KernelRow]:
    """Codec throughput: the torch kernels per device, the servers' codec on the CPU."""
    import numpy as np
    import torch

    from bpstrain import _codec

    threads = torch.get_num_threads()
    torch.set_num_threads(plan.kernel_threads)
    numel = int(plan.kernel_mbytes * (1 << 20)) // 4
    gb = 4 * numel / 1e9
    rows: list[KernelRow] = []
    try:
        for device in plan.kernel_devices:
            if device == "cuda" and not torch.cuda.is_available():
                continue
            x = torch.randn(numel, device=device)
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            for codec in KERNEL_CODECS:
                where = f"torch {device}" + (f", {plan.kernel_threads} thread(s)" if device == "cpu" else "")
                try:
                    t = _best(_torch_codec(codec, plan, x), plan.kernel_repeat, sync)
                    rows.append(KernelRow(codec, where, gb / t))
                except Exception as exc:  # noqa: BLE001 - one codec's failure is its row
                    rows.append(KernelRow(codec, where, None, f"failed: {first_error_line(str(exc))}"))
                _log(f"[compression] kernel {codec:<10} {where}: "
                     + (f"{rows[-1].gb_per_s:.2f} GB/s" if rows[-1].gb_per_s else rows[-1].outcome))
            del x
        rows += _server_kernels(plan, numel, np, _codec)
    finally:
        torch.set_num_threads(threads)
    return rows


def _server_kernels(plan: CompressionPlan, numel: int, np, _codec) -> list[KernelRow]:
    """``CompressedRounds().round`` on ``kernel_workers`` pushes (numpy-reference blobs)."""
    from bpstrain._core import CompressedRounds

    rng = np.random.default_rng(0)
    rows = []
    where = f"server, {plan.kernel_workers} pushes"
    for codec in SERVER_CODECS:
        code = _codec.CODECS[codec]
        pushes = []
        for _ in range(plan.kernel_workers):
            x = rng.standard_normal(numel, dtype=np.float32)
            blobs = []
            for start, n in _chunks(numel):
                extra = ({"k": _codec.topk_count(n, plan.topk_ratio)} if codec == "topk"
                         else {"levels": plan.dithering_levels} if codec == "dithering" else {})
                blobs.append(_codec.encode(code, x[start:start + n], **extra))
            pushes.append(b"".join(blobs))
        server = CompressedRounds()
        version = iter(range(1 << 30))
        t = _best(lambda: server.round(1, next(version), pushes), plan.kernel_repeat, lambda: None)
        rows.append(KernelRow(codec, where, plan.kernel_workers * 4 * numel / 1e9 / t))
        _log(f"[compression] kernel {codec:<10} {where}: {rows[-1].gb_per_s:.2f} GB/s")
    return rows


def _chunks(numel: int):
    from bpstrain import _codec

    start = 0
    for n in _codec.chunk_sizes(numel):
        yield start, n
        start += n


# -- the run ------------------------------------------------------------------------------

def run(plan: CompressionPlan) -> list:
    """Runs the chosen parts; one cluster per rate (wire at every rate, time to accuracy
    at ``tta_rate_mbit``, accuracy at equal steps on the first cluster)."""
    rows: list = []
    network = [p for p in plan.parts if p != "kernels"]
    if network and plan.loopback:
        hosts = LoopbackHosts()
        if "wire" in network:
            rows += run_wire(hosts, plan, None)
        if "accuracy" in network:
            rows += run_accuracy(hosts, plan)
            rows += run_tta(hosts, plan, None)
    elif network:
        rates = list(dict.fromkeys(plan.rates_mbit)) if "wire" in network else []
        if "accuracy" in network and plan.tta_rate_mbit not in rates:
            rates.append(plan.tta_rate_mbit)
        for i, rate in enumerate(rates):
            _log(f"[compression] emulated cluster: {plan.hosts} worker hosts, {plan.servers} "
                 f"server hosts, scheduler host, {rate:g} Mbit/s")
            with emulated.EmulatedCluster(plan.hosts + plan.servers + 1, rate,
                                          latency_ms=plan.latency_ms) as cluster:
                hosts = EmulatedHosts(cluster)
                if "wire" in network and rate in plan.rates_mbit:
                    rows += run_wire(hosts, plan, rate)
                if "accuracy" in network and i == 0:
                    rows += run_accuracy(hosts, plan)
                if "accuracy" in network and rate == plan.tta_rate_mbit:
                    rows += run_tta(hosts, plan, rate)
    if "kernels" in plan.parts:
        rows += run_kernels(plan)
    return rows


def _f(value, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def _note(outcome: str) -> str:
    return "" if outcome == "ok" else outcome.replace("|", "/")


def _x(value, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt) + "x"


def markdown(headers: Sequence[str], lines: Sequence[Sequence[str]], left: int = 1) -> str:
    """A markdown table (as the README's), cells padded to their column's width: the
    first ``left`` columns and a last "note" column left-aligned, the others right."""
    lines = [tuple(headers), *(tuple(line) for line in lines)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    lefts = [i < left or (i == len(headers) - 1 and headers[i] == "note")
             for i in range(len(headers))]
    text = ["| " + " | ".join(cell.ljust(w) if lefts[i] else cell.rjust(w)
                              for i, (cell, w) in enumerate(zip(line, widths))) + " |"
            for line in lines]
    text.insert(1, "|" + "|".join("-" * (w + 2) if lefts[i] else "-" * (w + 1) + ":"
                                  for i, w in enumerate(widths)) + "|")
    return "\n".join(text)


def format_tables(rows: Sequence, plan: CompressionPlan) -> str:
    """The markdown tables of the parts that ran."""
    out = []
    wire = [r for r in rows if isinstance(r, WireRow)]
    for rate in dict.fromkeys(r.rate_mbit for r in wire):
        where = "loopback, no caps" if rate is None else f"{rate:g} Mbit/s per host"
        images = ("8x8" if plan.model.startswith("digits_")
                  else f"{plan.image_size}x{plan.image_size}")
        out.append(f"\nStep time and bytes on the wire: {plan.model}, {plan.hosts} worker hosts, "
                   f"{plan.servers} server hosts, {where}, batch {plan.batch_size} per worker, "
                   f"{images} synthetic images, {plan.device}, median of {plan.iters} steps; "
                   "bytes: tx + rx of the worker hosts' links"
                   + (" (loopback: all of lo's traffic, seen by worker 0)" if plan.loopback else "")
                   + "\n")
        out.append(markdown(
            ["system", "step s", "vs none", "vs DDP+fp16", "MB/step on worker links",
             "bytes: none / this", "note"],
            [[r.label, _f(r.step_s, ".3f"), _x(r.vs_none), _x(r.vs_ddp_fp16),
              _f(r.wire_bytes_per_step and r.wire_bytes_per_step / 1e6, ".2f"),
              _x(r.bytes_vs_none, ".1f"), _note(r.outcome)]
             for r in wire if r.rate_mbit == rate]))
    acc = [r for r in rows if isinstance(r, AccuracyRow) and r.target is None]
    if acc:
        seeds = (f", mean of {plan.acc_seeds} seeds (initial weights and batches)"
                 if plan.acc_seeds > 1 else "")
        out.append(f"\nAccuracy at equal steps: {plan.acc_model}, {acc[0].steps} steps, "
                   f"{plan.hosts} workers, batch {plan.acc_batch} per worker, SGD lr {plan.lr:g} "
                   f"momentum 0.9, digits test split{seeds}\n")
        out.append(markdown(["system", "test accuracy", "points vs none", "per seed", "note"],
                          [[r.label, _f(r.accuracy, ".4f"), _f(r.points_vs_none, "+.2f"),
                            " ".join(f"{a:.4f}" for a in r.seed_accuracies or []),
                            _note(r.outcome)] for r in acc]))
    tta = [r for r in rows if isinstance(r, AccuracyRow) and r.target is not None]
    if tta:
        where = "loopback, no caps" if tta[0].rate_mbit is None else f"{tta[0].rate_mbit:g} Mbit/s"
        out.append(f"\nTime to {plan.tta_target:.0%} test accuracy: {tta[0].model} (a "
                   f"communication-heavy digits model, chosen so the link matters), "
                   f"{plan.hosts} workers, {where}, at most {tta[0].steps} steps, evaluated "
                   f"every {plan.eval_every} steps (off the clock)\n")
        out.append(markdown(
            ["system", "time to target s", "steps", "vs DDP+fp16", "step s", "final accuracy",
             "note"],
            [[r.label, _f(r.time_to_target_s, ".2f", "not reached" if r.outcome == "ok" else "-"),
              _f(r.steps_to_target, "d"), _x(r.vs_ddp_fp16),
              _f(r.step_s, ".3f"), _f(r.accuracy, ".4f"), _note(r.outcome)] for r in tta]))
    kern = [r for r in rows if isinstance(r, KernelRow)]
    if kern:
        out.append(f"\nCodec throughput, GB/s of dense fp32 input, {plan.kernel_mbytes:g} MB "
                   "tensor (torch: compress + decompress incl. the worker residual; server: "
                   "decode every push, sum, re-encode)\n")
        out.append(markdown(["codec", "where", "GB/s", "note"],
                          [[r.codec, r.where, _f(r.gb_per_s, ".2f"), _note(r.outcome)]
                           for r in kern], left=2))
    return "\n".join(out).lstrip("\n")


# -- command line -------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this benchmark's flags (used by ``bpstrain.bench.cli``)."""
    d = CompressionPlan()
    a = parser.add_argument
    a("--part", nargs="+", choices=PARTS, default=list(PARTS), dest="parts")
    a("--rate-mbit", type=float, nargs="+", default=list(d.rates_mbit),
      help="per-host link caps of the wire part, one cluster each")
    a("--hosts", type=int, default=d.hosts, help="worker hosts (one worker each)")
    a("--servers", type=int, default=d.servers, help="server hosts")
    a("--systems", nargs="+", choices=SYSTEMS, default=list(d.systems), help="wire part")
    a("--topk-ratio", type=float, default=d.topk_ratio)
    a("--randomk-ratio", type=float, default=d.randomk_ratio)
    a("--powersgd-rank", type=int, default=d.powersgd_rank)
    a("--dithering-levels", type=int, default=d.dithering_levels)
    a("--auto-spec", default=d.auto_spec, help="system 'auto': its spec (compression where it "
      "pays; on loopback with no cap it should cost little against none)")
    a("--model", default=d.model, help="wire part's model (bench.training's)")
    a("--batch-size", type=int, default=d.batch_size, help="wire part, per worker")
    a("--image-size", type=int, default=d.image_size)
    a("--num-classes", type=int, default=d.num_classes)
    a("--iters", type=int, default=d.iters, help="timed steps (wire)")
    a("--warmup", type=int, default=d.warmup,
      help="untimed steps first (wire; DDP's PowerSGD hook compresses from step 2 on)")
    a("--device", choices=["cpu", "cuda"], default=d.device,
      help="wire part: where the workers train (cuda: the emulated hosts share the GPU)")
    a("--acc-systems", nargs="+", choices=SYSTEMS, default=list(d.acc_systems))
    a("--acc-model", choices=["digits_cnn", "digits_mlp"], default=d.acc_model)
    a("--acc-steps", type=int, default=d.acc_steps)
    a("--acc-seeds", type=int, default=d.acc_seeds,
      help="accuracy part: runs per system (seeds 0..N-1), the table gives their mean")
    a("--acc-batch", type=int, default=d.acc_batch, help="per worker")
    a("--lr", type=float, default=d.lr)
    a("--eval-every", type=int, default=d.eval_every)
    a("--tta-systems", nargs="+", choices=SYSTEMS, default=list(d.tta_systems))
    a("--tta-rate-mbit", type=float, default=d.tta_rate_mbit)
    a("--tta-hidden", type=int, default=d.tta_hidden, help="digits_mlp hidden units")
    a("--tta-steps", type=int, default=d.tta_steps)
    a("--tta-target", type=float, default=d.tta_target, help="test accuracy, 0..1")
    a("--kernel-mbytes", type=float, default=d.kernel_mbytes)
    a("--kernel-repeat", type=int, default=d.kernel_repeat)
    a("--kernel-workers", type=int, default=d.kernel_workers, help="pushes per server round")
    a("--kernel-threads", type=int, default=d.kernel_threads, help="torch threads (CPU)")
    a("--loopback", action="store_true", help="no namespaces, no caps (no root needed)")
    a("--latency-ms", type=float, default=d.latency_ms, help="tbf queue latency")
    a("--timeout", type=float, default=d.timeout_s, help="seconds per job")
    a("--hook-timeout", type=float, default=d.hook_timeout_s,
      help="seconds per DDP PowerSGD job (known to crash or hang on gloo); gloo's "
           "collective timeout is a quarter of it (of --timeout for the other DDP jobs: half)")


def needs_root(args: argparse.Namespace) -> bool:
    """Whether these flags build emulated hosts."""
    return not args.loopback and any(p != "kernels" for p in args.parts)


def plan_from_args(args: argparse.Namespace) -> CompressionPlan:
    """The plan of parsed flags."""
    return CompressionPlan(
        parts=args.parts, rates_mbit=args.rate_mbit, hosts=args.hosts, servers=args.servers,
        systems=args.systems, topk_ratio=args.topk_ratio, randomk_ratio=args.randomk_ratio,
        powersgd_rank=args.powersgd_rank, dithering_levels=args.dithering_levels,
        auto_spec=args.auto_spec,
        model=args.model, batch_size=args.batch_size, image_size=args.image_size,
        num_classes=args.num_classes, iters=args.iters, warmup=args.warmup, device=args.device,
        acc_systems=args.acc_systems, acc_model=args.acc_model, acc_steps=args.acc_steps,
        acc_seeds=args.acc_seeds,
        acc_batch=args.acc_batch, lr=args.lr, eval_every=args.eval_every,
        tta_systems=args.tta_systems, tta_rate_mbit=args.tta_rate_mbit,
        tta_hidden=args.tta_hidden, tta_steps=args.tta_steps, tta_target=args.tta_target,
        kernel_mbytes=args.kernel_mbytes, kernel_repeat=args.kernel_repeat,
        kernel_workers=args.kernel_workers, kernel_threads=args.kernel_threads,
        loopback=args.loopback, latency_ms=args.latency_ms, timeout_s=args.timeout,
        hook_timeout_s=args.hook_timeout)


def run_args(args: argparse.Namespace) -> tuple[str, str, list[dict]]:
    """Runs the benchmark for parsed flags; returns ``(title, tables, json records)``."""
    plan = plan_from_args(args)
    rows = run(plan)
    title = ("gradient compression: bpstrain's compressors vs torch DDP's communication hooks"
             + (" (loopback, no caps)" if plan.loopback else ""))
    return title, format_tables(rows, plan), [dataclasses.asdict(r) for r in rows]


def main(argv: list[str] | None = None) -> int:
    """``python -m bpstrain.bench.compression``: same as ``python -m bpstrain.bench compression``."""
    from bpstrain.bench import cli

    return cli.main(["compression", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
