"""One worker of the sparse-embedding benchmark (:mod:`bpstrain.bench.sparse`): a DLRM-like
model generated in code — an ``nn.EmbeddingBag`` of ``--rows`` x ``--dim`` fp32 (sum of
``--fields`` ids per sample, drawn from a Zipf distribution) under a linear head — trained
with SGD for ``--steps`` timed steps after ``--warmup``:

* ``bpstrain-sparse``: ``sparse=True`` embedding, ``bpstrain.torch.DistributedOptimizer``
  (the embedding's rows go through the row-sparse push_pull);
* ``bpstrain-dense``: ``sparse=False``: the whole table's gradient is push_pulled;
* ``bpstrain-table``: the table kept by the servers (``bpstrain.torch.ServerEmbeddingBag``,
  sparse SGD applied there; each worker pulls its batch's rows and pushes their gradients),
  the head through ``DistributedOptimizer``;
* ``bpstrain-prefetch``: ``bpstrain-table`` with the next batch's rows prefetched after each
  forward (``ServerEmbeddingBag.prefetch``), so they travel while the step's push does;
* ``ddp``: ``sparse=True`` under torch DDP over gloo (sparse all-reduce by all-gather).

Prints one ``BENCH_RESULT`` line: ``times`` (seconds per timed step), ``rx``/``tx`` (bytes
of ``--ifname`` in this namespace over the timed steps, from /proc/net/dev), ``own_rows``
and ``union_rows`` (per step: this worker's unique ids, and the rows of the averaged
gradient = the union over workers; bpstrain-sparse only).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import signal
import sys
import time

import numpy as np

from bpstrain.bench import _report
from bpstrain.bench._compress_worker import link_counters


def make_model(args, sparse: bool):
    """The embedding bag under a linear head (an nn.Module: DDP wraps it)."""
    import torch

    class Dlrm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if args.system in ("bpstrain-table", "bpstrain-prefetch"):
                import bpstrain.torch as bps

                self.emb = bps.ServerEmbeddingBag(args.rows, args.dim, name="dlrm.emb", mode="sum", lr=args.lr)
            else:
                self.emb = torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=sparse)
            self.head = torch.nn.Linear(args.dim, 1)

        def forward(self, ids, offsets):
            return self.head(self.emb(ids, offsets))

    torch.manual_seed(0)
    return Dlrm()


def batch(args, rank: int, step: int):
    import torch

    rng = np.random.default_rng(7919 * rank + step)
    ids = (rng.zipf(args.zipf, args.batch * args.fields) - 1) % args.rows
    offsets = np.arange(0, args.batch * args.fields, args.fields)
    return (torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(offsets.astype(np.int64)),
            torch.from_numpy(rng.random((args.batch, 1)).astype(np.float32)))


def run(args) -> tuple[int, int, dict]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    sparse = args.system != "bpstrain-dense"
    model = make_model(args, sparse)
    if args.system == "ddp":
        import os

        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname  # the host's link, not the loopback
        dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=args.rank,
                                world_size=args.world_size, timeout=datetime.timedelta(seconds=args.timeout))
        rank, size = dist.get_rank(), dist.get_world_size()
        net = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    else:
        import bpstrain.torch as bps

        bps.init()
        rank, size = bps.rank(), bps.size()
        net = model
        optimizer = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                             named_parameters=model.named_parameters())

    def step_fn(ids, offsets, y, next_ids):
        optimizer.zero_grad()
        out = net(ids, offsets)
        if args.system == "bpstrain-prefetch" and next_ids is not None:
            model.emb.prefetch(next_ids)  # pulled as soon as this step's push starts
        F.binary_cross_entropy_with_logits(out, y).backward()
        optimizer.step()

    times, union = [], []
    rx0 = tx0 = 0
    # Made before the clock starts: drawing Zipf ids takes CPU the other ranks' timed steps
    # (on the same cores) would pay for.
    batches = [batch(args, rank, step) for step in range(args.warmup + args.steps)]
    for step, (ids, offsets, y) in enumerate(batches):
        if step == args.warmup:
            rx0, tx0 = link_counters(args.ifname)
        start = time.perf_counter()
        step_fn(ids, offsets, y, batches[step + 1][0] if step + 1 < len(batches) else None)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            grad = getattr(model.emb, "weight", None)
            grad = None if grad is None else grad.grad
            union.append(int(grad._nnz()) if grad is not None and grad.is_sparse else 0)
    rx1, tx1 = link_counters(args.ifname)
    own = [int(np.unique(ids.numpy()).size) for ids, _, _ in batches[args.warmup:]]
    result = {"times": times, "rx": rx1 - rx0, "tx": tx1 - tx0, "own_rows": own, "union_rows": union}
    if args.system == "ddp":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    else:
        import bpstrain.torch as bps
        from bpstrain import engine

        if args.system in ("bpstrain-table", "bpstrain-prefetch"):
            model.emb.synchronize()
        engine.barrier()
        bps.shutdown()
    return rank, size, result


def main(argv=None) -> int:
    """Command-line entry point; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m bpstrain.bench._sparse_worker")
    p.add_argument("--system", choices=("bpstrain-sparse", "bpstrain-table", "bpstrain-prefetch", "bpstrain-dense",
                                        "ddp"),
                   required=True)
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--fields", type=int, default=26)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ifname", default="lo")
    p.add_argument("--addr", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rank, size, result = run(args)
    _report.emit(args.system, rank, size, [result])
    return 0


if __name__ == "__main__":
    sys.exit(main())
