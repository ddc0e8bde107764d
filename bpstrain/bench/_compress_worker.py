"""One worker of the gradient compression benchmark (:mod:`bpstrain.bench.compression`).

Two tasks, each for bpstrain (``--system bpstrain --compression SPEC``, a spec string of
:func:`bpstrain._compression.parse_compression`: none, fp16, onebit, topk:0.01, ...) or
torch DDP over gloo (``--system ddp --compression none|fp16|bf16|powersgd|powersgd-batched``,
DDP's communication hooks):

* ``--task wire``: synthetic-image SGD steps of a benchmark model (the training
  benchmark's step, :func:`bpstrain.bench._train_worker._timed_steps`), timed, and the
  bytes this host's interface (``--ifname``) sent and received during the timed steps,
  read from ``/proc/net/dev`` (per network namespace: inside an emulated host it is that
  host's link) before and after them::

    python -m bpstrain.bench._compress_worker --task wire --system bpstrain \
        --compression topk:0.01 --model vgg16 --iters 3 --ifname eth0

* ``--task accuracy``: ``--steps`` SGD steps on this rank's shard of the digits training
  split, the test accuracy every ``--eval-every`` steps (evaluation off the clock), with
  the training time up to each evaluation::

    python -m bpstrain.bench._compress_worker --task accuracy --system ddp --compression fp16 \
        --model digits_mlp --hidden 4096 --steps 200 --addr 10.213.0.1 --port 23000 \
        --rank 0 --world-size 4 --ifname eth0

Prints one ``BENCH_RESULT`` line (:mod:`bpstrain.bench._report`) whose single result is
``{"times": [...], "tx": bytes, "rx": bytes}`` (wire) or ``{"curve": [[step, seconds,
accuracy], ...], "times": [...], "tx", "rx"}`` (accuracy).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import signal
import sys
import time

from bpstrain.bench import _report

STEPS_DONE = "compress worker: steps done, result printed"
DDP_HOOKS = ("none", "fp16", "bf16", "powersgd", "powersgd-batched")


def link_counters(ifname: str) -> tuple[int, int]:
    """(rx bytes, tx bytes) of ``ifname`` in this process's network namespace."""
    with open("/proc/net/dev", encoding="ascii") as handle:
        for line in handle:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == ifname:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    raise ValueError(f"Expected interface {ifname!r} in /proc/net/dev of this namespace.")


MOMENTUM = 0.9  # the accuracy task's SGD momentum (and the momentum-corrected systems')


def make_compression(spec: str):
    """The ``bpstrain.torch.Compression`` object of a spec string (``"topk:0.01"``)."""
    from bpstrain._compression import parse_compression
    from bpstrain.torch import Compression

    s = parse_compression(spec)
    if s.codec in ("none", "fp16", "bf16"):
        return getattr(Compression, s.codec)
    if s.codec == "onebit":
        return Compression.onebit(scaling=s.scaled)
    if s.codec == "topk":
        return Compression.topk(s.ratio, momentum=s.momentum)
    if s.codec == "randomk":
        return Compression.randomk(s.ratio)
    if s.codec == "dithering":
        return Compression.dithering(s.levels)
    if s.codec == "powersgd":
        return Compression.powersgd(s.rank)
    if s.codec == "auto":
        return Compression.from_spec(s)
    raise ValueError(f"Expected a codec the benchmark knows. Received: {spec!r}")


def _register_hook(model, hook: str, rank: int, start_iter: int):
    """DDP's communication hook ``hook`` on ``model`` (PowerSGD from step ``start_iter``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook.startswith("powersgd"):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=start_iter)
        fn = (powerSGD_hook.batched_powerSGD_hook if hook == "powersgd-batched"
              else powerSGD_hook.powerSGD_hook)
        model.register_comm_hook(state, fn)


class _Session:
    """The process group of one system: wraps the model and optimizer, ends the job."""

    def __init__(self, args) -> None:
        self.args = args
        if args.system == "bpstrain":
            import bpstrain.torch as bps

            bps.init()
            self.rank, self.size = bps.rank(), bps.size()
        else:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}",
                                    rank=args.rank, world_size=args.world_size,
                                    timeout=datetime.timedelta(seconds=args.timeout))
            self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def wrap(self, model, optimizer):
        """(model, optimizer) to train with: DistributedOptimizer, or DDP with its hook."""
        args = self.args
        if args.system == "bpstrain":
            import bpstrain.torch as bps

            optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                 compression=make_compression(args.compression))
            bps.broadcast_parameters(model.state_dict(), root_rank=0)
            return model, optimizer
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        _register_hook(model, args.compression, args.powersgd_rank, args.powersgd_start)
        return model, optimizer

    def close(self, ok: bool) -> None:
        """Barrier (after a run that worked: a failed rank must exit, not wait), then
        leave the job."""
        if self.args.system == "bpstrain":
            import bpstrain.torch as bps
            from bpstrain import engine

            try:
                if ok:
                    engine.barrier()
            finally:
                bps.shutdown()
        else:
            import torch.distributed as dist

            try:
                if ok:
                    dist.barrier()
            finally:
                dist.destroy_process_group()


def run_wire(args, session: _Session) -> dict:
    """Warmup steps, counters, timed steps, counters (the training benchmark's step)."""
    from bpstrain.bench._train_worker import _build, _timed_steps

    if args.model.startswith("digits_"):  # tiny: smoke runs (8x8 single-channel images)
        import torch

        torch.manual_seed(0)
        model = _digits_model(args).to(args.device)
        data = torch.randn(args.batch_size, 1, 8, 8).to(args.device)
        target = torch.randint(10, (args.batch_size,)).to(args.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    else:
        model, optimizer, data, target = _build(args)
    model, optimizer = session.wrap(model, optimizer)
    _timed_steps(model, optimizer, data, target, 0, args.warmup)
    rx0, tx0 = link_counters(args.ifname)
    times, phases = _timed_steps(model, optimizer, data, target, args.iters, 0)
    rx1, tx1 = link_counters(args.ifname)
    return {"model": args.model, "batch": args.batch_size, "times": times, "phases": phases,
            "rx": rx1 - rx0, "tx": tx1 - tx0}


def _digits_model(args):
    from bpstrain.models import get_model

    if args.model == "digits_mlp":
        return get_model("digits_mlp", hidden=args.hidden)
    return get_model(args.model)


def run_accuracy(args, session: _Session) -> dict:
    """``--steps`` steps on this rank's shard of the digits training split; the test
    accuracy every ``--eval-every`` steps and at the end, with the training time so far."""
    import torch
    import torch.nn.functional as F

    from bpstrain.models.data import digits_dataset

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = _digits_model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    model, optimizer = session.wrap(model, optimizer)
    train, test = digits_dataset("train"), digits_dataset("test")
    x, y = train.tensors
    shard = torch.arange(session.rank, len(y), session.size)
    gen = torch.Generator().manual_seed(1000 + session.rank + 7919 * args.seed)
    explicit_sync = hasattr(optimizer, "synchronize")

    def accuracy() -> float:
        net = model.module if hasattr(model, "module") else model
        with torch.no_grad():
            net.eval()
            pred = net(test.tensors[0]).argmax(1)
            net.train()
        return float((pred == test.tensors[1]).float().mean())

    curve, times, elapsed = [], [], 0.0
    rx0, tx0 = link_counters(args.ifname)
    for step in range(1, args.steps + 1):
        batch = shard[torch.randint(len(shard), (args.batch_size,), generator=gen)]
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x[batch]), y[batch]).backward()
        if explicit_sync:
            optimizer.synchronize()
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        times.append(time.perf_counter() - start)
        elapsed += times[-1]
        if step % args.eval_every == 0 or step == args.steps:
            curve.append([step, elapsed, accuracy()])
    rx1, tx1 = link_counters(args.ifname)
    return {"model": args.model, "batch": args.batch_size, "curve": curve, "times": times,
            "rx": rx1 - rx0, "tx": tx1 - tx0}


def main(argv=None) -> int:
    """Command-line entry point; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m bpstrain.bench._compress_worker")
    p.add_argument("--task", choices=["wire", "accuracy"], required=True)
    p.add_argument("--system", choices=["bpstrain", "ddp"], required=True)
    p.add_argument("--compression", default="none",
                   help="bpstrain: a compression spec; ddp: " + "|".join(DDP_HOOKS))
    p.add_argument("--powersgd-rank", type=int, default=2, help="ddp powersgd hooks")
    p.add_argument("--powersgd-start", type=int, default=2,
                   help="ddp powersgd hooks: plain all-reduce before this step (torch needs > 1)")
    p.add_argument("--model", default="vgg16")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=4096, help="digits_mlp's hidden width")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0, help="accuracy: initial weights and batches")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=MOMENTUM)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--addr"), p.add_argument("--port", type=int)
    p.add_argument("--rank", type=int), p.add_argument("--world-size", type=int)
    p.add_argument("--ifname", default="lo", help="interface whose counters are read")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.system == "ddp" and args.compression not in DDP_HOOKS:
        p.error(f"--system ddp takes --compression {'|'.join(DDP_HOOKS)}")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks before a kill (_jobs)
    import torch

    torch.set_num_threads(args.threads)
    if args.system == "ddp":
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    session = _Session(args)
    ok = False
    try:
        result = (run_wire if args.task == "wire" else run_accuracy)(args, session)
        ok = True
    finally:
        session.close(ok)
    _report.emit(f"{args.system}:{args.compression}", session.rank, session.size, [result])
    # The parent's report of a process that fails later (at exit) says its steps ran.
    print(STEPS_DONE, file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
