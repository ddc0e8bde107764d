"""DistributedDataParallel on the push_pull engine (the ``torch.nn.parallel`` API).

    model = bps.parallel.DistributedDataParallel(model)   # broadcasts rank 0's state
    loss = loss_fn(model(x), y)
    loss.backward()              # returns with every p.grad averaged over ranks
    optimizer.step()             # a plain torch optimizer

    with model.no_sync():        # accumulate locally, no communication
        loss_fn(model(x1), y1).backward()
    loss_fn(model(x2), y2).backward()   # averages the sum of both passes

Each gradient starts its push_pull from a hook as soon as it is ready (front layers
first); a callback at the end of backward waits for all of them. Parameters that got
no gradient on this rank contribute zeros, so unused parameters never hang a job.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Dict

import torch

from bpstrain.torch import _compressors, _unused, ops
from bpstrain.torch.compression import Compression
from bpstrain.torch.functions import broadcast_parameters

_instances = itertools.count()


class DistributedDataParallel(torch.nn.Module):
    """Wraps ``module``; gradients are averaged over ranks during ``backward()``.

    Args:
        module: the model; rank 0's parameters and buffers are broadcast at construction.
        device_ids: accepted for torch compatibility; the module's own devices are used.
        broadcast_buffers: copy rank 0's buffers (BatchNorm statistics) to every rank at
            the start of each forward pass in training mode. Evaluation-mode forwards
            never communicate, so rank-0-only validation is safe.
        compression: ``Compression.none`` / ``fp16`` / ``bf16``, or a lossy compressor,
            policy or spec as for :func:`~bpstrain.torch.DistributedOptimizer` (applied
            per parameter by name, with worker-side error feedback). Its state is not
            part of the module's ``state_dict()``: checkpoint it with
            :meth:`compression_state_dict`.
    """

    def __init__(self, module: torch.nn.Module, device_ids=None, broadcast_buffers: bool = True,
                 compression=Compression.none):
        super().__init__()
        del device_ids
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self._compression = compression
        self._prefix = f"DistributedDataParallel.{next(_instances)}"
        named = list(module.named_parameters())
        self._names = {id(p): f"{self._prefix}.{n}" for n, p in named}
        self._priority = {id(p): -i for i, (_, p) in enumerate(named)}
        self._params = [p for _, p in named]
        self._keys = {id(p): n for n, p in named}
        # Lossy compressors work per parameter with state (see DistributedOptimizer).
        self._codec = _compressors.for_optimizer(compression)
        self._stateful, self._classic = {}, {}
        if self._codec is not None:
            for n, p in named:
                classic, stateful = self._codec.choose(n, p.numel())
                if stateful is not None:
                    self._stateful[id(p)] = stateful
                else:
                    self._classic[id(p)] = classic
        self._handles: Dict[int, tuple] = {}
        self._hooked = set()
        self._sync = True
        self._callback_queued = False
        self._active = ops.distributed()
        broadcast_parameters(module.state_dict(), root_rank=0, prefix=f"{self._prefix}.init")
        if self._active:
            self._register_hooks()

    def forward(self, *args, **kwargs):
        """Runs the wrapped module (after syncing buffers, see ``broadcast_buffers``)."""
        if self._active and self.broadcast_buffers and self.training and ops.size() > 1:
            self._broadcast_buffers()
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward passes inside this context only accumulate gradients locally."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def _register_hooks(self):
        for p in self._params:
            if p.requires_grad and id(p) not in self._hooked:
                p.register_post_accumulate_grad_hook(self._hook)
                self._hooked.add(id(p))

    def _hook(self, p):
        if not self._sync:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        self._handles[id(p)] = (p,) + self._start(p) + (True,)

    def compression_state_dict(self) -> dict:
        """The lossy compressors' state (error-feedback residuals, PowerSGD's Q, step
        counters), keyed by parameter name; empty for none/fp16/bf16."""
        return self._codec.state_dict() if self._codec is not None else {}

    def load_compression_state_dict(self, state: dict) -> None:
        """Restores :meth:`compression_state_dict` (each rank its own)."""
        if self._codec is not None and state:
            self._codec.load_state_dict(state)

    def _start(self, p):
        stateful = self._stateful.get(id(p))
        if stateful is not None:  # its handle's result is the average itself
            handle = stateful.push_pull_async(p.grad, self._names[id(p)], True,
                                              self._priority[id(p)], key=self._keys[id(p)],
                                              inplace=True)
            return handle, None, None
        compressed, ctx = self._classic.get(id(p), self._compression).compress(p.grad)
        handle = ops.push_pull_async_inplace(compressed, average=True, name=self._names[id(p)],
                                             priority=self._priority[id(p)])
        return handle, compressed, ctx

    def _finish(self):
        """End of backward: push what did not get a gradient here, then wait for all."""
        self._callback_queued = False
        for p in self._params:
            if p.requires_grad and id(p) not in self._handles:
                had_grad = _unused.zeros_if_missing(p)
                self._handles[id(p)] = (p,) + self._start(p) + (had_grad,)
        try:
            for p, handle, compressed, ctx, had_grad in self._handles.values():
                result = ops.synchronize(handle)
                if compressed is None:
                    _compressors.copy_result(p.grad, result)
                elif compressed is not p.grad:
                    compression = self._classic.get(id(p), self._compression)
                    p.grad.copy_(compression.decompress(compressed, ctx))
                _unused.none_if_unused(p, had_grad)
        finally:
            self._handles.clear()
        self._register_hooks()  # parameters unfrozen since construction

    def _broadcast_buffers(self):
        groups: Dict[tuple, list] = {}
        for b in self.module.buffers():
            if b is not None and b.numel() > 0:
                groups.setdefault((b.dtype, b.device), []).append(b)
        # One flat broadcast per dtype and device instead of one per buffer.
        for i, buffers in enumerate(groups.values()):
            flat = torch.cat([b.detach().reshape(-1) for b in buffers])
            ops.broadcast_(flat, 0, name=f"{self._prefix}.buffers{i}")
            offset = 0
            with torch.no_grad():
                for b in buffers:
                    b.copy_(flat[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()
