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
get names from a per-process counter, so ranks must issue them in the same order.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Optional

import torch

from bpstrain import engine
from bpstrain.config.env import read_env
from bpstrain.errors import MismatchError
from bpstrain.torch import _tensors
from bpstrain.torch.compression import Compression


class _Runtime:
    """State of the torch layer between init() and shutdown()."""

    def __init__(self) -> None:
        self.distributed = read_env().distributed
        self.chunk_bytes = int(engine.options()["partition_bytes"])
        self.op_timeout = float(engine.options()["op_timeout"])
        self.handles: Dict[int, Any] = {}
        self.ids = itertools.count(1)
        self.unnamed = itertools.count()
        self.checked: set = set()
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
    """BytePS compatibility: names are declared at first use, so this only validates."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"declare() takes a non-empty tensor name. Received: name={name!r}")


class _Done:
    """An operation that finished when it was started (standalone CUDA tensors)."""

    def __init__(self, result: torch.Tensor):
        self.result = result

    def poll(self) -> bool:
        return True

    def wait(self, timeout: float) -> torch.Tensor:
        return self.result


class _HostOp:
    """One engine operation on CPU memory."""

    def __init__(self, handle: int, result: torch.Tensor):
        self.handle, self.result, self.done = handle, result, False

    def poll(self) -> bool:
        self.done = self.done or engine.poll(self.handle)
        return self.done

    def wait(self, timeout: float) -> torch.Tensor:
        engine.synchronize(self.handle, timeout)
        return self.result


class _Then:
    """Runs ``after(result)`` once ``inner`` is done (copy-back, decompression)."""

    def __init__(self, inner, after):
        self.inner, self.after = inner, after

    def poll(self) -> bool:
        return self.inner.poll()

    def wait(self, timeout: float) -> torch.Tensor:
        return self.after(self.inner.wait(timeout))


def _copy_back(result: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        result.copy_(out)
    return result


def _start(tensor: torch.Tensor, output: torch.Tensor, name: Optional[str], kind: str,
           average: bool = True, priority: int = 0, root: int = 0) -> int:
    rt = _runtime()
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{kind} takes a torch.Tensor. Received: {type(tensor).__name__}")
    dtype = _tensors.engine_dtype(tensor)
    named = name is not None
    if name is None:
        name = f"torch.{kind}.noname.{next(rt.unnamed)}"
    if kind == "broadcast" and not 0 <= root < size():
        raise ValueError(f"root_rank must be in [0, {size()}). Received: root_rank={root}")
    result, inplace = output, tensor is output
    tensor, output = tensor.detach(), output.detach()
    staged = not output.is_contiguous()  # the engine needs contiguous memory
    if staged:
        output = torch.empty_like(output, memory_format=torch.contiguous_format)
        if inplace:
            output.copy_(tensor)
    src = output if inplace else tensor.contiguous()
    if tensor.is_cuda:
        if not rt.distributed and size() == 1:
            if src is not output:
                output.copy_(src)
            op = _Done(output)
        else:
            check = name not in rt.checked
            rt.checked.add(name)
            op = rt.cuda_stager().submit(src, output, name, kind, average, priority, root,
                                         rank(), check, reuse=named)
    else:
        array, out = _tensors.host_view(src), _tensors.host_view(output)
        if kind == "broadcast":
            handle = engine.broadcast_async(array, root, name, out=out, dtype=dtype, priority=priority)
        else:
            handle = engine.push_pull_async(array, name, average, priority, out=out, dtype=dtype)
        op = _HostOp(handle, output)
    op = _Then(op, (lambda out: _copy_back(result, out)) if staged else (lambda out: result))
    op.label = f"{kind} of '{name}' ({tensor.device.type} {str(tensor.dtype)[6:]} {tuple(tensor.shape)})"
    handle = next(rt.ids)
    rt.handles[handle] = op
    return handle


def push_pull_async(tensor, average=True, name=None, version=0, priority=0) -> int:
    """Starts summing (``average=False``) or averaging ``tensor`` over ranks.

    Args:
        tensor: any supported dtype, CPU or CUDA; left unchanged.
        average: divide the sum by :func:`size` (integers: floor division).
        name: the same on every rank; ``None`` uses a per-process counter.
        version: ignored (BytePS compatibility).
        priority: larger is sent sooner; gradients use ``-parameter_index``.

    Returns:
        A handle for :func:`poll` / :func:`synchronize` (which returns a new tensor).
    """
    del version
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format).detach()
    return _start(tensor, output, name, "push_pull", average, priority)


def push_pull_async_inplace(tensor, average=True, name=None, version=0, priority=0) -> int:
    """Like :func:`push_pull_async`, writing the result into ``tensor`` itself."""
    del version
    return _start(tensor, tensor, name, "push_pull", average, priority)


def poll(handle: int) -> bool:
    """True when the operation behind ``handle`` has finished (never blocks)."""
    return _op(handle).poll()


def _op(handle: int):
    try:
        return _runtime().handles[handle]
    except KeyError:
        raise ValueError(f"unknown handle (already synchronized?). Received: handle={handle!r}") from None


def synchronize(handle: int) -> torch.Tensor:
    """Waits for ``handle``; returns the output tensor (``tensor`` itself for in-place ops).

    Raises:
        MismatchError: ranks passed different shapes, dtypes or device types for the name.
        PeerError / BpsTimeoutError: a peer died or the op took longer than ``op_timeout``.
    """
    rt = _runtime()
    op = _op(handle)
    try:
        return op.wait(rt.op_timeout)
    except MismatchError as exc:
        raise MismatchError(
            f"{op.label} does not match the other ranks: {exc} (CUDA tensors are declared "
            "with one extra trailing dimension of size 1, so a CPU tensor on one rank and a "
            "CUDA tensor on another shows up as a shape mismatch).") from exc
    finally:
        rt.handles.pop(handle, None)


class _PushPull(torch.autograd.Function):
    """push_pull as a differentiable op: the gradient is push_pulled the same way."""

    @staticmethod
    def forward(ctx, tensor, average, name, priority):
        ctx.average, ctx.name, ctx.priority = average, name, priority
        return synchronize(push_pull_async(tensor, average, name, priority=priority))

    @staticmethod
    def backward(ctx, grad):
        name = None if ctx.name is None else f"{ctx.name}.grad"
        out = synchronize(push_pull_async(grad, ctx.average, name, priority=ctx.priority))
        return out, None, None, None


def push_pull(tensor, average=True, name=None, version=0, priority=0,
              compression=Compression.none) -> torch.Tensor:
    """Blocking, differentiable push_pull; returns a new tensor.

    The gradient flows back through another push_pull: for ``y = push_pull(x,
    average=False)``, ``y.sum().backward()`` gives ``x.grad == size()``.

    Args:
        compression: ``Compression.fp16`` sends floating tensors as float16.
    """
    del version
    compressed, ctx = compression.compress(tensor)
    return compression.decompress(_PushPull.apply(compressed, average, name, priority), ctx)


def push_pull_inplace(tensor, average=True, name=None, version=0, priority=0) -> torch.Tensor:
    """Blocking in-place push_pull; returns ``tensor``."""
    return synchronize(push_pull_async_inplace(tensor, average, name, version, priority))


def broadcast_async(tensor, root_rank, name=None, priority=0) -> int:
    """Starts copying ``root_rank``'s ``tensor`` to every rank into a new tensor."""
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format).detach()
    return _start(tensor, output, name, "broadcast", priority=priority, root=root_rank)


def broadcast_async_(tensor, root_rank, name=None, priority=0) -> int:
    """Starts overwriting ``tensor`` with ``root_rank``'s value, in place."""
    return _start(tensor, tensor, name, "broadcast", priority=priority, root=root_rank)


def broadcast(tensor, root_rank, name=None) -> torch.Tensor:
    """Returns ``root_rank``'s ``tensor`` on every rank (exact, any dtype)."""
    return synchronize(broadcast_async(tensor, root_rank, name))


def broadcast_(tensor, root_rank, name=None) -> torch.Tensor:
    """Overwrites ``tensor`` with ``root_rank``'s value; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name))
