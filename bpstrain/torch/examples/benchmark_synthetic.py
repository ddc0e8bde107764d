"""Synthetic-data training throughput, after BytePS's ``example/pytorch/benchmark_byteps.py``.

    # one process, plain PyTorch (the baseline)
    python -m bpstrain.torch.examples.benchmark_synthetic --mode local
    # bpstrain, 2 workers and 1 server on this host
    python -m bpstrain.launch --workers 2 --servers 1 -- \
        python -m bpstrain.torch.examples.benchmark_synthetic --model resnet50
    # torch DDP over gloo on the same processes (torchrun sets RANK/WORLD_SIZE/MASTER_*)
    torchrun --nproc-per-node 2 -m bpstrain.torch.examples.benchmark_synthetic --mode ddp

Prints BytePS's lines (``Iter #i: X img/sec per GPU``, ``Total img/sec on N GPU(s)``);
``--json PATH`` also writes the numbers (rank 0).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import timeit

import numpy as np
import torch
import torch.nn.functional as F

from bpstrain.models import get_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="PyTorch synthetic benchmark (bpstrain)")
    p.add_argument("--cross-barrier", action="store_true",
                   help="bpstrain.torch.CrossBarrier: step() does not wait; each layer's "
                        "update is applied right before its next forward")
    p.add_argument("--fp16-pushpull", action="store_true", help="push_pull gradients as float16")
    p.add_argument("--model", default="resnet50", help="a bpstrain.models name")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--image-channels", type=int, default=3)
    p.add_argument("--no-cuda", action="store_true", help="train on CPU")
    p.add_argument("--mode", choices=["bpstrain", "local", "ddp"], default="bpstrain",
                   help="bpstrain DistributedOptimizer, plain single-process torch, or torch DDP")
    p.add_argument("--ddp-backend", default="gloo", help="torch.distributed backend for --mode ddp")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (rank 0)")
    return p.parse_args(argv)


class _Comm:
    """rank/size and the model/optimizer wrapping of the chosen mode."""

    def __init__(self, args):
        self.mode = args.mode
        if self.mode == "bpstrain":
            import bpstrain.torch as bps

            bps.init()
            self.bps, self.rank, self.size, self.local_rank = bps, bps.rank(), bps.size(), bps.local_rank()
        elif self.mode == "ddp":
            import torch.distributed as dist

            dist.init_process_group(args.ddp_backend)
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        else:
            self.rank, self.size, self.local_rank = 0, 1, 0

    def wrap(self, model, optimizer, fp16, cross_barrier=False):
        if self.mode == "bpstrain":
            bps = self.bps
            compression = bps.Compression.fp16 if fp16 else bps.Compression.none
            # CrossBarrier takes the model first; otherwise both wrap alike.
            wrap = functools.partial(bps.CrossBarrier, model) if cross_barrier else bps.DistributedOptimizer
            optimizer = wrap(optimizer, named_parameters=model.named_parameters(), compression=compression)
            bps.broadcast_parameters(model.state_dict(), root_rank=0)
            bps.broadcast_optimizer_state(optimizer, root_rank=0)
        elif self.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.local_rank % torch.cuda.device_count()] if next(model.parameters()).is_cuda else None
            model = DistributedDataParallel(model, device_ids=ids)
            if fp16:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return model, optimizer

    def close(self):
        if self.mode == "bpstrain":
            self.bps.shutdown()
        elif self.mode == "ddp":
            torch.distributed.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    cuda = not args.no_cuda and torch.cuda.is_available()
    comm = _Comm(args)
    if cuda:
        torch.cuda.set_device(comm.local_rank % torch.cuda.device_count())
    device = torch.device("cuda" if cuda else "cpu")
    model = get_model(args.model, num_classes=args.num_classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * comm.size)
    model, optimizer = comm.wrap(model, optimizer, args.fp16_pushpull, args.cross_barrier)
    # CrossBarrier leaves the last updates for the next forward; a timed block ends
    # with all of them applied so it holds every step's whole work.
    finish = optimizer.synchronize if args.cross_barrier and comm.mode == "bpstrain" else (lambda: None)
    torch.manual_seed(comm.rank)
    data = torch.randn(args.batch_size, args.image_channels, args.image_size, args.image_size,
                       device=device)
    target = torch.randint(args.num_classes, (args.batch_size,), device=device)

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def timed(number):
        def run():
            for _ in range(number):
                benchmark_step()
            finish()
            if cuda:
                torch.cuda.synchronize()
        return timeit.timeit(run, number=1)

    def log(text):
        if comm.rank == 0:
            print(text, flush=True)

    kind = "GPU" if cuda else "CPU"
    log(f"Model: {args.model}\nBatch size: {args.batch_size}\nMode: {args.mode}"
        f"{' (fp16 push_pull)' if args.fp16_pushpull else ''}"
        f"{' (cross-barrier)' if args.cross_barrier else ''}\nNumber of {kind}s: {comm.size}")
    log("Running warmup...")
    timed(args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for i in range(args.num_iters):
        img_sec = args.batch_size * args.num_batches_per_iter / timed(args.num_batches_per_iter)
        log(f"Iter #{i}: {img_sec:.1f} img/sec per {kind}")
        img_secs.append(img_sec)
    mean, conf = float(np.mean(img_secs)), float(1.96 * np.std(img_secs))
    log(f"Img/sec per {kind}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {comm.size} {kind}(s): {comm.size * mean:.1f} +-{comm.size * conf:.1f}")
    if args.json and comm.rank == 0:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"model": args.model, "mode": args.mode, "fp16": args.fp16_pushpull,
                       "batch_size": args.batch_size, "size": comm.size,
                       "img_sec_per_worker": mean, "conf": conf, "total": comm.size * mean}, handle)
    comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
