"""One worker of the stragglers benchmark (:mod:`bpstrain.bench.stragglers`).

A bpstrain job (BytePS's ``DMLC_*`` variables; scheduler and servers running) trains a
digits model with ``DistributedOptimizer`` for ``--steps`` steps; each step's compute is
the model's real forward and backward plus ``--compute-ms`` of emulated compute (a
sleep, so that four workers on two cores keep the time a larger model would take), and
stragglers are injected the same way::

    BPSTRAIN_AGGREGATE=k:3 python -m bpstrain.bench._straggler_worker --steps 200 \
        --compute-ms 40 --straggle transient

(``BPSTRAIN_CONSISTENCY=ssp:4`` or ``async`` puts the optimizer on the servers;
``--catch-up`` lets a k-of-n worker that fell behind skip the rounds it missed, the loop
then ending by rounds.)

``--straggle``: ``none``; ``transient`` (each step, each worker stalls for
``--stall-factor`` x compute with probability ``--stall-prob``, from a seeded generator
per rank); ``persistent`` (rank ``--slow-rank`` computes ``--stall-factor`` x longer
every step). The stall comes between forward and backward, before the gradients leave.

Prints one ``BENCH_RESULT`` line (:mod:`bpstrain.bench._report`) whose single result is
``{"times": [seconds per step], "wall": seconds, "late": partitions, "curve": [[step,
seconds, accuracy], ...]}`` (the curve on rank 0 only: test accuracy every
``--eval-every`` steps, evaluation off the clock).
"""

from __future__ import annotations

import argparse
import faulthandler
import random
import signal
import sys
import time

from bpstrain.bench import _report

STRAGGLE = ("none", "transient", "persistent")


def stall_s(args, rank: int, rng: random.Random) -> float:
    """Extra seconds this rank computes in this step under ``args.straggle``."""
    compute = args.compute_ms / 1000.0
    if args.straggle == "transient":
        return (args.stall_factor * compute) if rng.random() < args.stall_prob else 0.0
    if args.straggle == "persistent" and rank == args.slow_rank:
        return (args.stall_factor - 1.0) * compute
    return 0.0


def run(args) -> tuple[int, int, dict]:
    """Trains; returns (rank, size, result)."""
    import torch
    import torch.nn.functional as F

    import bpstrain.torch as bps
    from bpstrain import engine
    from bpstrain.models import get_model
    from bpstrain.models.data import digits_dataset

    bps.init()
    rank, size = bps.rank(), bps.size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = get_model("digits_mlp", hidden=args.hidden)
    if args.pad_mbytes > 0:
        # Gradient bytes of a larger model: a parameter the loss touches (so it gets a
        # gradient every step) without changing what the model computes.
        model.pad = torch.nn.Parameter(torch.zeros(int(args.pad_mbytes * (1 << 20)) // 4))
    optimizer = bps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum),
        named_parameters=model.named_parameters(), catch_up=args.catch_up)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    train, test = digits_dataset("train"), digits_dataset("test")
    x, y = train.tensors
    shard = torch.arange(rank, len(y), size)
    gen = torch.Generator().manual_seed(1000 + rank + 7919 * args.seed)
    rng = random.Random(31 * rank + args.seed)

    def accuracy() -> float:
        with torch.no_grad():
            model.eval()
            pred = model(test.tensors[0]).argmax(1)
            model.train()
        return float((pred == test.tensors[1]).float().mean())

    late0 = engine.stats()["late_partitions"]
    curve, times, elapsed = [], [], 0.0
    wall0 = time.perf_counter()
    step = 0
    while optimizer.rounds < args.steps:  # = steps, unless a slow worker catches up
        step += 1
        batch = shard[torch.randint(len(shard), (args.batch_size,), generator=gen)]
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[batch]), y[batch])
        if args.pad_mbytes > 0:
            loss = loss + 0.0 * model.pad.sum()
        time.sleep(args.compute_ms / 1000.0 + stall_s(args, rank, rng))
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        elapsed += times[-1]
        if rank == 0 and (step % args.eval_every == 0 or optimizer.rounds >= args.steps):
            curve.append([step, elapsed, accuracy()])
    wall = time.perf_counter() - wall0
    stats = engine.stats()
    result = {"times": times, "wall": wall, "late": stats["late_partitions"] - late0,
              "staleness": stats.get("max_staleness", 0), "curve": curve, "batch": args.batch_size}
    engine.barrier()
    bps.shutdown()
    return rank, size, result


def main(argv=None) -> int:
    """Command-line entry point; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m bpstrain.bench._straggler_worker")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256, help="digits_mlp's hidden width")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compute-ms", type=float, default=40.0, help="emulated compute per step")
    p.add_argument("--straggle", choices=STRAGGLE, default="none")
    p.add_argument("--stall-prob", type=float, default=0.1)
    p.add_argument("--stall-factor", type=float, default=2.0)
    p.add_argument("--slow-rank", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--pad-mbytes", type=float, default=0.0,
                   help="extra gradient megabytes a step (a padding parameter)")
    p.add_argument("--catch-up", action="store_true",
                   help="k-of-n: DistributedOptimizer(catch_up=True), a slow worker skips rounds")
    args = p.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks before a kill (_jobs)
    import torch

    torch.set_num_threads(1)
    rank, size, result = run(args)
    _report.emit("bpstrain", rank, size, [result])
    return 0


if __name__ == "__main__":
    sys.exit(main())
