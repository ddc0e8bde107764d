"""Tensor fusion: small gradients travel together, one push_pull per bucket.

Every operation has a fixed cost (hook, staging, engine bookkeeping) that dwarfs the
transfer of a BatchNorm bias; ResNet-50 has 132 parameters under 1 MiB holding 6 MiB
in all. Consecutive small parameters (in backward order, same device and dtype) share
a flat buffer of at most ``bucket_bytes``; the bucket is sent as soon as its last
member's gradient is ready, with the priority of its front-most member. Large
parameters keep one operation each (zero-copy on CPU, chunked on CUDA).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from bpstrain.torch import _unused, ops


class Bucket:
    """Small parameters sent as one flat tensor under ``name``."""

    def __init__(self, name: str, params: List[torch.Tensor], priority: int):
        self.name, self.params, self.priority = name, params, priority
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.buffer: Optional[torch.Tensor] = None
        self.ready: set = set()
        self.handle = None
        self.ctx = None
        self.compressed = None
        self.sparse: set = set()  # ids of members whose gradient came sparse (sent dense here)

    def views(self) -> List[torch.Tensor]:
        """The members' slices of the flat buffer, shaped like the members."""
        return [self.buffer[o:o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]

    def complete(self) -> bool:
        """Every member that requires a gradient now has one ready."""
        return all(id(p) in self.ready or not p.requires_grad for p in self.params)

    def launch(self, compression, average: bool = True) -> None:
        """Packs the members' gradients (zeros where none) and starts the push_pull."""
        p0 = self.params[0]
        if self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=p0.dtype, device=p0.device)
        grads, views, empty = [], [], []
        for p, view in zip(self.params, self.views()):
            if p.requires_grad and p.grad is not None:
                if p.grad.is_sparse:  # a small embedding: dense in the bucket, sparse again after
                    self.sparse.add(id(p))
                    grads.append(p.grad.to_dense())
                else:
                    grads.append(p.grad)
                views.append(view)
            else:
                empty.append(view)
        if grads:
            torch._foreach_copy_(views, grads)
        for view in empty:
            view.zero_()
        self.compressed, self.ctx = compression.compress(self.buffer)
        self.handle = ops.push_pull_async_inplace(self.compressed, average=average, name=self.name,
                                                  priority=self.priority)

    def finish(self, compression, had_grad: Dict[int, bool]) -> None:
        """Waits, then writes the averages back into the members' gradients."""
        ops.synchronize(self.handle)
        if self.compressed is not self.buffer:
            self.buffer.copy_(compression.decompress(self.compressed, self.ctx))
        targets, sources = [], []
        for p, view in zip(self.params, self.views()):
            if not p.requires_grad:
                continue
            if id(p) in self.sparse:
                p.grad = view.to_sparse(1)  # the rows some rank touched (nonzero)
                continue
            _unused.zeros_if_missing(p)  # none at launch: the bucket sent zeros for it
            targets.append(p.grad)
            sources.append(view)
        if targets:
            torch._foreach_copy_(targets, sources)
        for p in self.params:
            _unused.none_if_unused(p, had_grad.get(id(p)))
        self.reset()

    def reset(self) -> None:
        """Forgets this step (the buffer is kept for the next)."""
        self.ready.clear()
        self.sparse.clear()
        self.handle = self.ctx = self.compressed = None


def plan_buckets(params: List[torch.Tensor], prefix: str, threshold_bytes: int,
                 bucket_bytes: int, exclude: Optional[set] = None) -> List[Bucket]:
    """Groups consecutive small parameters (walking backward) into buckets.

    ``exclude``: ids of parameters that keep an operation of their own (compressed per
    parameter, by name).
    """
    exclude = exclude or set()
    buckets: List[Bucket] = []
    group: List[int] = []
    size = 0

    def close():
        nonlocal group, size
        if len(group) > 1:  # a bucket of one would only add a copy
            members = [params[i] for i in sorted(group)]
            buckets.append(Bucket(f"{prefix}bucket{len(buckets)}", members, -min(group)))
        group, size = [], 0

    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if threshold_bytes <= 0 or nbytes >= threshold_bytes or p.is_sparse or id(p) in exclude:
            close()
            continue
        if group and (size + nbytes > bucket_bytes or p.device != params[group[0]].device
                      or p.dtype != params[group[0]].dtype):
            close()
        group.append(i)
        size += nbytes
    close()
    return buckets
