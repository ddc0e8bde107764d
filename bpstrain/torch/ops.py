"""Collective operations on torch tensors (BytePS/Horovod names and signatures).

    import torch
    import bpstrain.torch as bps

    bps.init()
    avg = bps.push_pull(torch.ones(3), name="x")                 # mean over ranks
    handle = bps.push_pull_async_inplace(grad, average=True, name="g", priority=-5)
    ...                                                           # overlap other work
    bps.synchronize(handle)                                       # grad now averaged

CPU tensors cross into the engine as numpy views of their own memory (no copy when
contiguous). CUDA tensors are staged through pinned host memory chunk by chunk (see
:mod:`bpstrain.torch._cuda`); results land on the tensor's device. Every rank must use
the same name for the same tensor (same shape, dtype and device type); unnamed calls
get names from the engine's per-process counter, so ranks must issue them in the same
order. Handles are the engine's own (:mod:`bpstrain.engine` keeps the one handle table
of the process), so :func:`synchronize` and :func:`bpstrain.engine.synchronize` are one.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np
import torch

from bpstrain import engine
from bpstrain.engine import Op
from bpstrain.torch import _tensors
from bpstrain.torch.compression import Compression, GradientCompressor

_DTYPES = _tensors.ENGINE_DTYPES
_SCALAR = (1,)  # the shape a 0-d tensor is sent with
# Host array -> result tensor, per engine dtype (torch.from_numpy itself where it can).
_WRAP = {name: torch.from_numpy for name in engine.DTYPES}
_WRAP["bfloat16"] = functools.partial(_tensors.from_host, dtype=torch.bfloat16)
# Dtypes whose tensors are their own numpy view (all but bfloat16): the fast path's table.
_PLAIN = {dtype: name for dtype, name in _DTYPES.items() if name != "bfloat16"}


class _Runtime:
    """State of the torch layer between init() and shutdown()."""

    def __init__(self) -> None:
        self.distributed = engine.env().distributed
        self.chunk_bytes = _tensors.chunk_bytes(engine.options()["partition_bytes"])
        self.stager = None  # created at the first CUDA op

    def cuda_stager(self):
        if self.stager is None:
            from bpstrain.torch._cuda import Stager

            self.stager = Stager(self.chunk_bytes)
        return self.stager


_rt: Optional[_Runtime] = None


def init(config: Any = None) -> None:
    """Joins the job described by the environment (idempotent).

    Without ``DMLC_ROLE`` the process runs alone (rank 0 of 1). See
    :func:`bpstrain.engine.init` for ``config``.
    """
    global _rt
    engine.init(config)
    if _rt is None:
        _rt = _Runtime()


def shutdown() -> None:
    """Leaves the job (idempotent); :func:`init` may be called again afterwards."""
    global _rt
    rt, _rt = _rt, None
    if rt is not None and rt.stager is not None:
        rt.stager.close()
    engine.shutdown()


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _rt is not None and engine.is_initialized()


def _runtime() -> _Runtime:
    if _rt is None:
        raise ValueError("bpstrain.torch has not been initialized; call bpstrain.torch.init() first.")
    return _rt


def rank() -> int:
    """This worker's rank in [0, size())."""
    return engine.rank()


def size() -> int:
    """Number of worker processes in the job."""
    return engine.size()


def local_rank() -> int:
    """Rank among the workers of this host; use it to pick the GPU."""
    return engine.local_rank()


def local_size() -> int:
    """Number of workers on this host."""
    return engine.local_size()


def distributed() -> bool:
    """True in a launched job (even of one worker); False when running standalone."""
    return _runtime().distributed or size() > 1


def declare(name: str) -> None:
    """BytePS compatibility: names are declared at first use, so this only validates.

    A name may be used again with another shape, dtype or device when every rank does
    so: that use declares it afresh (see :func:`bpstrain.engine.declare`).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"declare() takes a non-empty tensor name. Received: name={name!r}")


def _copy_back(staged: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        result.copy_(staged)
    return result


def _start(tensor: torch.Tensor, inplace: bool, name: Optional[str], op: Op,
           priority: int = 0, root: int = 0) -> int:
    """Validates ``tensor`` once and queues ``op``: the one path of every collective here.

    Returns an engine handle; :func:`engine.synchronize` gives the result tensor
    (``tensor`` itself when ``inplace``). Everything before the engine call is on the
    critical path of a small operation (every rank waits for the slowest to enqueue),
    so the common case, a contiguous CPU tensor, does as little as possible.
    """
    rt = _rt or _runtime()
    try:
        dtype = _DTYPES[tensor.dtype]
    except (KeyError, AttributeError):
        if not isinstance(tensor, torch.Tensor):
            kind = "broadcast" if op == Op.BROADCAST else "push_pull"
            raise ValueError(f"{kind} takes a torch.Tensor. Received: {type(tensor).__name__}") from None
        dtype = _tensors.engine_dtype(tensor)  # raises the unsupported-dtype error
    named = name is not None
    if not named:
        name = engine.auto_name("torch.broadcast" if op == Op.BROADCAST else "torch.push_pull")
    result = tensor
    if tensor.requires_grad:
        tensor = tensor.detach()  # the engine writes memory autograd does not see
    if tensor.is_cuda:
        return _start_cuda(rt, tensor, inplace, result, name, named, op, priority, root)
    if not inplace:
        src = _tensors.host_view(tensor if tensor.is_contiguous() else tensor.contiguous())
        # The result is allocated by numpy and wrapped for torch once the engine has the
        # operation: a third of the cost of torch.empty_like + .numpy() before it
        # (the result's storage is not resizable, as with torch.from_numpy).
        # numpy's shape tuple: pybind11 reads a torch.Size element by element, slowly.
        return engine.submit(name, dtype, src.shape or _SCALAR, src, np.empty_like(src), op,
                             root, priority, wrap=_WRAP[dtype])
    then = None
    if not tensor.is_contiguous():  # the engine needs contiguous memory: stage, copy back
        tensor = torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor)
        then = functools.partial(_copy_back, tensor)
    view = _tensors.host_view(tensor)
    return engine.submit(name, dtype, view.shape or _SCALAR, view, view, op, root, priority,
                         result=result, then=then)


def _start_cuda(rt, tensor, inplace, result, name, named, op, priority, root) -> int:
    """CUDA tensors: staged through pinned memory (see :mod:`bpstrain.torch._cuda`)."""
    if op == Op.BROADCAST and not 0 <= root < size():  # the staging threads report late
        raise ValueError(f"root_rank must be in [0, {size()}). Received: root_rank={root}")
    then = None
    if not inplace:
        result = output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        src = tensor if tensor.is_contiguous() else tensor.contiguous()
    elif tensor.is_contiguous():
        src = output = tensor
    else:
        src = output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        output.copy_(tensor)
        then = functools.partial(_copy_back, output)
    if not rt.distributed and size() == 1:
        if src is not output:
            output.copy_(src)
        return engine.track(None, then, result)
    staged = rt.cuda_stager().submit(src, output, name, op, priority, root, rank(), reuse=named)
    return engine.track(staged, then, result)


def push_pull_async(tensor, average=True, name=None, version=0, priority=0) -> int:
    """Starts summing (``average=False``) or averaging ``tensor`` over ranks.

    Args:
        tensor: any supported dtype, CPU or CUDA; left unchanged.
        average: divide the sum by :func:`size` (integers: floor division).
        name: the same on every rank; ``None`` uses a per-process counter. A name may
            be used again with another shape when every rank does so (re-declared).
        version: ignored (BytePS compatibility).
        priority: larger is sent sooner; gradients use ``-parameter_index``.

    Returns:
        A handle for :func:`poll` / :func:`synchronize` (which returns a new tensor).
    """
    return _start(tensor, False, name, Op.AVERAGE if average else Op.SUM, priority)


def push_pull_async_inplace(tensor, average=True, name=None, version=0, priority=0) -> int:
    """Like :func:`push_pull_async`, writing the result into ``tensor`` itself."""
    return _start(tensor, True, name, Op.AVERAGE if average else Op.SUM, priority)


def poll(handle: int) -> bool:
    """True when the operation behind ``handle`` has finished (never blocks)."""
    return engine.poll(handle)


def synchronize(handle: int) -> torch.Tensor:
    """Waits for ``handle``; returns the output tensor (``tensor`` itself for in-place ops).

    Waits at most ``comm.op_timeout`` seconds, with the GIL released (Ctrl-C works).

    Raises:
        MismatchError: ranks passed different shapes, dtypes or device types for the name.
        PeerError / BpsTimeoutError: a peer died or the op took longer than ``op_timeout``.
    """
    return engine.synchronize(handle)


class _PushPull(torch.autograd.Function):
    """push_pull as a differentiable op: the gradient is push_pulled the same way."""

    @staticmethod
    def forward(ctx, tensor, average, name, priority):
        ctx.average, ctx.name, ctx.priority = average, name, priority
        return engine.synchronize(push_pull_async(tensor, average, name, priority=priority))

    @staticmethod
    def backward(ctx, grad):
        name = None if ctx.name is None else f"{ctx.name}.grad"
        out = engine.synchronize(push_pull_async(grad, ctx.average, name, priority=ctx.priority))
        return out, None, None, None


def push_pull(tensor, average=True, name=None, version=0, priority=0,
              compression=Compression.none) -> torch.Tensor:
    """Blocking, differentiable push_pull; returns a new tensor.

    The gradient flows back through another push_pull: for ``y = push_pull(x,
    average=False)``, ``y.sum().backward()`` gives ``x.grad == size()``.

    A name is declared at its first use; a later call with another shape, dtype or
    device declares it again, checked across ranks like the first use: ranks that
    declare it differently all get :class:`~bpstrain.errors.MismatchError` (see
    :func:`bpstrain.engine.declare` for the whole policy).

    Args:
        compression: ``Compression.fp16`` / ``bf16`` send floating tensors as 16-bit
            floats (differentiable, as before). A stateful compressor
            (``Compression.topk(0.01)``, ``onebit()``, ``powersgd(2)``, ...; see
            :mod:`bpstrain.torch.compression`) needs ``name``, keeps its state for that
            name across calls (reuse the same object) and is not differentiable. Spec
            strings are taken for ``"none"``, ``"fp16"`` and ``"bf16"``.
    """
    if isinstance(compression, GradientCompressor):
        return engine.synchronize(compression.push_pull_async(tensor, name, average, priority))
    if isinstance(compression, (str, dict)):
        made = Compression.from_spec(compression)
        if not hasattr(made, "compressor"):  # only none/fp16/bf16 are stateless
            # A compressor made per call would forget its residuals and step counter.
            raise ValueError("push_pull takes a stateful compressor as an object; make it once "
                             "with Compression.from_spec(spec) and pass the same object every "
                             f"call. Received: compression={compression!r}")
        return push_pull(tensor, average, name, version, priority, made.compressor)
    if compression is Compression.none and not (
            getattr(tensor, "requires_grad", False) and torch.is_grad_enabled()):
        # Nothing to differentiate or compress: the thin path, one engine operation.
        op = Op.AVERAGE if average else Op.SUM
        dtype = _PLAIN.get(getattr(tensor, "dtype", None))
        if (dtype is not None and name is not None and not tensor.is_cuda and not tensor.requires_grad
                and tensor.is_contiguous()):
            # The common small-op case, by address (no numpy views): every rank waits for
            # the slowest to enqueue, so each microsecond counts.
            out = torch.empty_like(tensor)
            handle = engine.submit_at(name, dtype, tuple(tensor.shape) or _SCALAR, tensor, out,
                                      tensor.nbytes, op, priority)
            if handle is not None:
                return engine.synchronize(handle)
        return engine.synchronize(_start(tensor, False, name, op, priority))
    compressed, ctx = compression.compress(tensor)
    return compression.decompress(_PushPull.apply(compressed, average, name, priority), ctx)


def push_pull_inplace(tensor, average=True, name=None, version=0, priority=0) -> torch.Tensor:
    """Blocking in-place push_pull; returns ``tensor``."""
    return engine.synchronize(_start(tensor, True, name, Op.AVERAGE if average else Op.SUM,
                                     priority))


def broadcast_async(tensor, root_rank, name=None, priority=0) -> int:
    """Starts copying ``root_rank``'s ``tensor`` to every rank into a new tensor."""
    return _start(tensor, False, name, Op.BROADCAST, priority, root_rank)


def broadcast_async_(tensor, root_rank, name=None, priority=0) -> int:
    """Starts overwriting ``tensor`` with ``root_rank``'s value, in place."""
    return _start(tensor, True, name, Op.BROADCAST, priority, root_rank)


def broadcast(tensor, root_rank, name=None) -> torch.Tensor:
    """Returns ``root_rank``'s ``tensor`` on every rank (exact, any dtype)."""
    return engine.synchronize(_start(tensor, False, name, Op.BROADCAST, 0, root_rank))


def broadcast_(tensor, root_rank, name=None) -> torch.Tensor:
    """Overwrites ``tensor`` with ``root_rank``'s value; returns ``tensor``."""
    return engine.synchronize(_start(tensor, True, name, Op.BROADCAST, 0, root_rank))
