"""One worker of the training benchmark: synthetic-data SGD steps, timed.

bpstrain (cluster from BytePS's ``DMLC_*`` variables; scheduler and servers running)::

    python -m bpstrain.bench._train_worker --system bpstrain --model vgg16 --iters 3

torch DDP over gloo (rank 0 hosts the rendezvous at ``--addr:--port``)::

    python -m bpstrain.bench._train_worker --system ddp --addr 10.213.0.1 --port 23000 \
        --rank 0 --world-size 4 --ifname eth0 --model vgg16 --iters 3

unmodified torch DDP over the ``torch.distributed`` backend "bpstrain" (a bpstrain job, as
for ``--system bpstrain``; ranks and rendezvous come from the engine)::

    python -m bpstrain.bench._train_worker --system ddp-bpstrain --model vgg16 --iters 3

Prints one ``BENCH_RESULT`` line (see :mod:`bpstrain.bench._report`) whose single
result is ``{"model", "batch", "times": [seconds per step, ...], "phases": [[forward,
backward, gradient wait, update], ...]}``.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import functools
import os
import signal
import sys
import time

from bpstrain.bench import _report


def _build(args):
    import torch

    from bpstrain.models import get_model

    torch.manual_seed(0)
    device = torch.device(args.device)
    if device.type == "cuda":
        # Workers of several emulated hosts share the machine's GPUs.
        torch.cuda.set_device(int(os.environ.get("BYTEPS_LOCAL_RANK", "0")) % torch.cuda.device_count())
    model = get_model(args.model, num_classes=args.num_classes).to(device)
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size).to(device)
    target = torch.randint(args.num_classes, (args.batch_size,)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    return model, optimizer, data, target


def _clock(data):
    """perf_counter after the device has finished its queued work (CUDA runs async)."""
    if data.is_cuda:
        import torch

        torch.cuda.synchronize(data.device)
    return time.perf_counter()


def _timed_steps(model, optimizer, data, target, iters, warmup, cross_barrier=False,
                 tracer=None):
    """``tracer``: a :class:`bpstrain.bench._step_trace.StepTracer` that records the last step."""
    import torch.nn.functional as F

    times, phases = [], []
    explicit_sync = hasattr(optimizer, "synchronize") and not cross_barrier
    for i in range(warmup + iters):
        traced = tracer is not None and i == warmup + iters - 1
        if traced:
            tracer.start()
        start = _clock(data)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        forward = _clock(data)
        loss.backward()
        backward = _clock(data)  # (DDP: communication overlapped with backward ends here too)
        if explicit_sync:  # bpstrain: wait for the gradients
            optimizer.synchronize()
        synced = _clock(data)
        if explicit_sync:
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()  # CrossBarrier: returns at once; the next forward waits
        if cross_barrier and i in (warmup - 1, warmup + iters - 1):
            # The warmup's updates must not spill into the first timed forward; the last
            # step's updates count in its own time.
            optimizer.synchronize()
        end = _clock(data)
        if traced:
            tracer.stop([start, forward, backward, synced, end],
                        time.time_ns() / 1000.0 - time.perf_counter() * 1e6)
        if i >= warmup:
            times.append(end - start)
            # forward, backward, waiting for the gradients (bpstrain), optimizer update
            phases.append([forward - start, backward - forward, synced - backward, end - synced])
    return times, phases


def run_bpstrain(args):
    """Trains with bpstrain's DistributedOptimizer; returns (rank, size, times)."""
    import bpstrain.torch as bps
    from bpstrain import engine

    bps.init()
    try:
        model, optimizer, data, target = _build(args)
        compression = bps.Compression.fp16 if args.fp16 else bps.Compression.none
        # CrossBarrier takes the model first; otherwise both wrap alike.
        wrap = functools.partial(bps.CrossBarrier, model) if args.cross_barrier else bps.DistributedOptimizer
        optimizer = wrap(optimizer, named_parameters=model.named_parameters(), compression=compression)
        bps.broadcast_parameters(model.state_dict(), root_rank=0)
        tracer = None
        if args.trace:
            from bpstrain.bench._step_trace import StepTracer

            tracer = StepTracer(bps.rank())
        times = _timed_steps(model, optimizer, data, target, args.iters, args.warmup,
                             args.cross_barrier, tracer)
        if tracer is not None:
            _write_trace(tracer, args.trace, bps.rank())
        engine.barrier()
        return bps.rank(), bps.size(), times
    finally:
        bps.shutdown()


def _write_trace(tracer, prefix: str, rank: int) -> None:
    """Writes ``<prefix>.rank<R>.json`` and prints the step's one-line summary to stderr."""
    from bpstrain.bench._step_trace import summary

    line = summary(tracer.write(f"{prefix}.rank{rank}.json"))
    if line:
        print(f"[trace] {line}", file=sys.stderr, flush=True)


def run_alone(args):
    """One process, plain SGD, no communication: the compute part of a step."""
    model, optimizer, data, target = _build(args)
    return 0, 1, _timed_steps(model, optimizer, data, target, args.iters, args.warmup)


def run_ddp(args):
    """Trains with torch DDP over gloo, or over the bpstrain backend (``ddp-bpstrain``);
    returns (rank, size, times)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    timeout = datetime.timedelta(seconds=args.timeout)
    if args.system == "ddp-bpstrain":
        import bpstrain.torch as bps  # registers the backend

        dist.init_process_group("bpstrain", timeout=timeout)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}",
                                rank=args.rank, world_size=args.world_size, timeout=timeout)
    try:
        model, optimizer, data, target = _build(args)
        model = DistributedDataParallel(model)
        if args.fp16:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        times = _timed_steps(model, optimizer, data, target, args.iters, args.warmup)
        dist.barrier()
        return dist.get_rank(), dist.get_world_size(), times
    finally:
        dist.destroy_process_group()
        if args.system == "ddp-bpstrain":
            bps.shutdown()


def main(argv=None) -> int:
    """Command-line entry point; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m bpstrain.bench._train_worker")
    p.add_argument("--system", choices=["bpstrain", "ddp", "ddp-bpstrain", "alone"], required=True,
                   help="alone: one process, no communication (the compute time of a step)")
    p.add_argument("--model", default="vgg16")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--fp16", action="store_true", help="float16 gradients on the wire")
    p.add_argument("--cross-barrier", action="store_true",
                   help="bpstrain: CrossBarrier instead of DistributedOptimizer")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default="cpu", help="cpu or cuda (emulated hosts share the GPU)")
    p.add_argument("--addr"), p.add_argument("--port", type=int)
    p.add_argument("--rank", type=int), p.add_argument("--world-size", type=int)
    p.add_argument("--ifname", help="network interface gloo binds to")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--trace", metavar="PREFIX",
                   help="bpstrain: write the last step's Chrome trace to PREFIX.rank<R>.json "
                        "and a summary line to stderr")
    args = p.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks before a kill (_jobs)
    import torch

    torch.set_num_threads(args.threads)
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    run = {"bpstrain": run_bpstrain, "alone": run_alone}.get(args.system, run_ddp)
    rank, size, (times, phases) = run(args)
    _report.emit(args.system, rank, size, [{"model": args.model, "batch": args.batch_size,
                                            "times": times, "phases": phases}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
