"""Horovod's collective calls (``horovod.torch.mpi_ops``) on the push_pull engine.

    import bpstrain.torch as hvd          # was: import horovod.torch as hvd

    hvd.init()
    avg = hvd.allreduce(t, name="loss")               # op=hvd.Average by default
    total = hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5)
    hvd.allreduce_(grad, op=hvd.Average)              # in place
    rows = hvd.allgather(local_rows)                  # concatenated along dim 0
    hvd.barrier()

What maps and what does not: ``Average`` and ``Sum`` are what the servers compute;
``Adasum``, ``Min``, ``Max`` and ``Product`` raise ``NotImplementedError`` naming the
alternative, as do ``process_set`` and :func:`join` (a rank that stops early would
leave the servers waiting for its push).
"""

from __future__ import annotations

from typing import Optional

import torch

from bpstrain import engine
from bpstrain.torch import ops
from bpstrain.torch.compression import Compression

# Horovod's ReduceOp values (horovod/common/basics.py).
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
             Product: "Product"}


def _average(average: Optional[bool], op: Optional[int]) -> bool:
    """Horovod's rules for ``average``/``op``: True for Average, False for Sum."""
    if average is not None and op is not None:
        raise ValueError("The op parameter supersedes average; give only one of them. "
                         f"Received: average={average!r}, op={op!r}")
    if op is None:
        return average is None or bool(average)
    if op == Average:
        return True
    if op == Sum:
        return False
    if op == Adasum:
        raise NotImplementedError(
            "op=Adasum is not offered: bpstrain's parameter servers sum gradients, they do not "
            "run Adasum's pairwise combination. Use op=bpstrain.torch.Average (and scale the "
            "learning rate by size() as for Average). Received: op=Adasum")
    if op in (Min, Max, Product):
        raise NotImplementedError(
            f"op={_OP_NAMES[op]} is not offered: the parameter servers only sum. Use "
            "torch.distributed.all_reduce with ReduceOp."
            f"{ {Min: 'MIN', Max: 'MAX', Product: 'PRODUCT'}[op]} on a gloo group "
            "(torch.distributed.new_group(backend='gloo')). "
            f"Received: op={_OP_NAMES[op]}")
    raise ValueError(f"op must be bpstrain.torch.Average or Sum. Received: op={op!r}")


def _no_process_set(process_set) -> None:
    if process_set is not None:
        raise NotImplementedError(
            "process_set is not offered: every bpstrain collective spans all workers. "
            "Use torch.distributed.new_group(ranks, backend='gloo') for a subset. "
            f"Received: process_set={process_set!r}")


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """Horovod's ``allreduce``: the mean (``op=Average``, default) or sum over ranks.

    Differentiable (the gradient is allreduced the same way). Returns a new tensor.

    Args:
        tensor: any supported dtype, CPU or CUDA.
        average: deprecated in Horovod; ``True`` = Average, ``False`` = Sum.
        name: the same on every rank; ``None``: named by call order.
        compression: ``Compression.none`` or ``Compression.fp16``.
        op: ``Average`` or ``Sum`` (``Adasum``/``Min``/``Max``/``Product`` raise).
        prescale_factor, postscale_factor: multiply before / after the reduction.

    Raises:
        ValueError: both ``average`` and ``op`` given.
        NotImplementedError: an op the servers do not compute, or a ``process_set``.
    """
    _no_process_set(process_set)
    mean = _average(average, op)
    if prescale_factor != 1.0:
        tensor = tensor * prescale_factor
    out = ops.push_pull(tensor, average=mean, name=name, compression=compression)
    return out * postscale_factor if postscale_factor != 1.0 else out


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """In-place :func:`allreduce`; returns ``tensor``."""
    _no_process_set(process_set)
    handle = allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor)
    return ops.synchronize(handle)


class _Scaled:
    """An engine operation whose result is multiplied on completion (postscale_factor)."""

    def __init__(self, handle: int, factor: float):
        self.handle, self.factor = handle, factor

    def poll(self) -> bool:
        return engine.poll(self.handle)

    def wait(self, timeout):
        out = engine.synchronize(self.handle, timeout)
        with torch.no_grad():
            return out.mul_(self.factor)


def _async(tensor, inplace, average, name, op, prescale_factor, postscale_factor) -> int:
    mean = _average(average, op)
    if prescale_factor != 1.0:
        if inplace:
            with torch.no_grad():
                tensor.mul_(prescale_factor)
        else:
            tensor = tensor.detach() * prescale_factor
    start = ops.push_pull_async_inplace if inplace else ops.push_pull_async
    handle = start(tensor, average=mean, name=name)
    if postscale_factor == 1.0:
        return handle
    return engine.track(_Scaled(handle, postscale_factor))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None) -> int:
    """Starts :func:`allreduce`; :func:`synchronize` returns the new tensor."""
    _no_process_set(process_set)
    return _async(tensor, False, average, name, op, prescale_factor, postscale_factor)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None) -> int:
    """Starts :func:`allreduce_`; :func:`synchronize` returns ``tensor``."""
    _no_process_set(process_set)
    return _async(tensor, True, average, name, op, prescale_factor, postscale_factor)


def _gather(tensor: torch.Tensor, name: str) -> tuple:
    """Every rank's ``tensor`` (first dimensions may differ): one broadcast per rank."""
    size, rank = ops.size(), ops.rank()
    data = tensor.detach()
    if data.dim() == 0:
        raise ValueError("allgather needs a tensor of at least one dimension (it concatenates "
                         "along dim 0). Received: a 0-d tensor")
    counts = torch.zeros(size, dtype=torch.int64)
    counts[rank] = data.shape[0]
    counts = ops.push_pull(counts, average=False, name=f"{name}.counts").tolist()
    parts, handles = [], []
    for root, rows in enumerate(counts):
        part = data.contiguous() if root == rank else data.new_empty((rows, *data.shape[1:]))
        parts.append(part)
        handles.append(ops.broadcast_async_(part, root, name=f"{name}.{root}"))
    for handle in handles:
        ops.synchronize(handle)
    return torch.cat(parts), counts


class _Allgather(torch.autograd.Function):
    """allgather's gradient: the sum of every rank's gradient, this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, name):
        out, counts = _gather(tensor, name)
        ctx.name, ctx.start, ctx.rows = name, sum(counts[:ops.rank()]), counts[ops.rank()]
        return out

    @staticmethod
    def backward(ctx, grad):
        total = ops.push_pull(grad.contiguous(), average=False, name=f"{ctx.name}.grad")
        return total.narrow(0, ctx.start, ctx.rows), None


def allgather(tensor, name=None, process_set=None) -> torch.Tensor:
    """Horovod's ``allgather``: every rank's ``tensor`` concatenated along dim 0.

    Ranks may pass different first dimensions (the others must agree). Differentiable.
    Built from the engine's broadcast: each rank sends its rows once and receives the
    others' (plus one small push_pull of the row counts).
    """
    _no_process_set(process_set)
    name = name or engine.auto_name("torch.allgather")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor, name)
    return _gather(tensor, name)[0]


def barrier(process_set=None) -> None:
    """Blocks until every rank has called :func:`barrier` (Horovod/BytePS ``barrier()``)."""
    _no_process_set(process_set)
    engine.barrier()


def join(device=-1) -> int:
    """Not offered: raises ``NotImplementedError`` naming the alternative.

    Horovod's ``join`` lets ranks that ran out of data stop while the others keep
    allreducing; with parameter servers the others would wait for pushes that never come.
    """
    raise NotImplementedError(
        "join() is not offered: a rank that stops early would leave the parameter servers "
        "waiting for its pushes. Give every rank the same number of batches "
        "(torch.utils.data.DistributedSampler(..., drop_last=True), or bpstrain's Trainer, "
        "which shards evenly), then call bpstrain.torch.barrier() where Horovod scripts call "
        f"join(). Received: join(device={device!r})")
