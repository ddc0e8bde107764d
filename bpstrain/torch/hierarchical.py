"""Multi-GPU hierarchical push_pull: NCCL inside a host, the servers across hosts.

BytePS's fast path for hosts with several GPUs. For one tensor, on every local rank:

1. **reduce-scatter** over the host's GPUs (NCCL): local rank j ends up with slice j of
   the host's sum;
2. **D2H** of that slice into pinned host memory;
3. **push_pull** of slice j through the servers, in which only local rank j of each host
   takes part (``participants = hosts``): every host's link carries 1/L of the bytes;
4. **H2D** and **all-gather** over the host's GPUs: every GPU has the global sum.

Large tensors are cut into chunks (``chunk_bytes`` per GPU slice) and the stages are
pipelined: all reduce-scatters are queued at once on NCCL's stream, each chunk's slice is
handed to the engine as soon as its reduce-scatter is done, and the all-gathers are
queued as results come back. ``priority`` is passed to the engine, so front layers keep
going first across hosts.

The local group is any ``torch.distributed`` group of this host's ranks: NCCL for CUDA
tensors (keep ``NCCL_NVLS_ENABLE=0``), gloo for CPU tensors (used by the CPU tests,
which run the same code path). :func:`init_local_group` builds one from BytePS's
environment.
"""

from __future__ import annotations

import os
import tempfile
from typing import List, Optional

import torch
import torch.distributed as dist

from bpstrain import engine
from bpstrain.engine import Op
from bpstrain.torch import _tensors


def init_local_group(backend: Optional[str] = None, timeout_s: float = 120.0):
    """Initialises ``torch.distributed`` over this host's local ranks and returns WORLD.

    Rendezvous goes through a file named after the job's scheduler address and this
    host's ``DMLC_WORKER_ID``, so the local ranks of one host find each other without
    another port. ``backend`` defaults to NCCL when CUDA is available, else gloo.
    """
    import datetime

    if dist.is_initialized():
        return dist.group.WORLD
    env = engine.env()  # the engine is initialised first: same layout
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    tag = f"{env.root_uri}-{env.root_port}-{env.worker_id or 0}".replace("/", "_")
    path = os.path.join(tempfile.gettempdir(), f"bpstrain-local-{tag}")
    store = dist.FileStore(path, env.local_size)
    dist.init_process_group(backend, store=store, rank=env.local_rank, world_size=env.local_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    dist.barrier()
    if env.local_rank == 0 and os.path.exists(path):
        os.unlink(path)  # everyone has joined: the rendezvous file is no longer needed
    return dist.group.WORLD


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group):
    try:
        return dist.reduce_scatter_tensor(out, inp, group=group, async_op=True)
    except (RuntimeError, NotImplementedError):
        # gloo has no reduce_scatter_tensor: all-reduce and keep our slice (CPU tests).
        dist.all_reduce(inp, group=group)
        out.copy_(inp.view(-1, out.numel())[dist.get_rank(group)])
        return None


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group):
    try:
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
    except (RuntimeError, NotImplementedError):
        parts = list(out.view(-1, inp.numel()).unbind(0))
        dist.all_gather(parts, inp, group=group)
        return None


class GpuHierarchy:
    """Hierarchical push_pull of tensors on this host's devices (see the module doc).

    Args:
        group: this host's local ranks (``init_local_group()`` when None).
        chunk_bytes: bytes of one GPU's slice per pipeline chunk (default: the engine's
            ``partition_bytes``).
    """

    def __init__(self, group=None, chunk_bytes: Optional[int] = None):
        self._owns_group = group is None
        self.group = group if group is not None else init_local_group()
        self.local_size = dist.get_world_size(self.group)
        self.local_rank = dist.get_rank(self.group)
        self.size = engine.size()
        if self.size % self.local_size:
            raise ValueError(
                "every host must run the same number of ranks for the hierarchical path. "
                f"Received: size={self.size}, local group size={self.local_size}")
        self.hosts = self.size // self.local_size
        self.chunk_bytes = _tensors.chunk_bytes(chunk_bytes or engine.options()["partition_bytes"])
        self._pinned = {}

    def close(self) -> None:
        """Destroys the local process group if this object created it.

        Exiting with a live gloo/NCCL group can abort the interpreter at shutdown, so
        call this (or ``torch.distributed.destroy_process_group()``) before exiting.
        """
        if self._owns_group and dist.is_initialized():
            dist.barrier(group=self.group)  # nobody tears down while a peer still gathers
            dist.destroy_process_group()
        self._pinned.clear()

    def _host_buffer(self, key, like: torch.Tensor) -> torch.Tensor:
        buf = self._pinned.get(key)
        if buf is None or buf.numel() != like.numel() or buf.dtype != like.dtype:
            buf = torch.empty(like.numel(), dtype=like.dtype, pin_memory=like.is_cuda)
            self._pinned[key] = buf
        return buf

    def push_pull(self, tensor: torch.Tensor, name: str, average: bool = True,
                  priority: int = 0) -> torch.Tensor:
        """Sums (or averages) ``tensor`` over every rank of the job, in place; returns it."""
        if not tensor.is_contiguous():
            raise ValueError(f"the hierarchical path needs a contiguous tensor. Received: '{name}'")
        dtype = _tensors.engine_dtype(tensor)
        flat = tensor.view(-1)
        L = self.local_size
        per_slice = max(1, self.chunk_bytes // tensor.element_size())
        cuts = _tensors.pieces(flat.numel(), per_slice * L)
        chunks = []  # (start, stop, padded chunk, slice buffer)
        for start, stop in cuts:
            slice_len = max(1, -(-(stop - start) // L))
            padded = torch.zeros(slice_len * L, dtype=tensor.dtype, device=tensor.device)
            padded[: stop - start].copy_(flat[start:stop])
            chunks.append((start, stop, padded, torch.empty(slice_len, dtype=tensor.dtype,
                                                             device=tensor.device)))
        # 1. every reduce-scatter queued at once (NCCL runs them in order on its stream)
        works = [_reduce_scatter(sl, padded, self.group) for _, _, padded, sl in chunks]
        # 2. each slice goes to the servers as soon as its reduce-scatter is done
        handles: List[Optional[int]] = []
        for i, ((_, _, _, sl), work) in enumerate(zip(chunks, works)):
            if work is not None:
                work.wait()
            if self.hosts == 1:
                handles.append(None)
                continue
            host = self._host_buffer((name, i), sl)
            host.copy_(sl)  # D2H into pinned memory (synchronous: the engine reads it next)
            view = _tensors.host_view(host)
            layout = _tensors.cut_layout(f"hierarchical{L}", per_slice * tensor.element_size(),
                                         i, len(chunks), tensor.shape)
            # The sum lands in the pinned buffer itself; synchronize() returns that tensor.
            handles.append(engine.submit(
                f"{name}.c{i}.s{self.local_rank}", dtype, view.shape, view, view, Op.SUM,
                priority=priority, participants=self.hosts, device=tensor.device.type,
                layout=layout, result=host))
        # 3. results come back: H2D, then all-gather inside the host
        gathers = []
        for i, ((_, _, padded, sl), handle) in enumerate(zip(chunks, handles)):
            if handle is not None:
                sl.copy_(engine.synchronize(handle))  # H2D from the pinned buffer
            gathers.append(_all_gather(padded, sl, self.group))
        for (start, stop, padded, _), work in zip(chunks, gathers):
            if work is not None:
                work.wait()
            flat[start:stop].copy_(padded[: stop - start])
        if average:
            _tensors.average_(tensor, self.size)
        return tensor
