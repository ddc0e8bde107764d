"""CUDA tensors: host staging through pinned memory, pipelined chunk by chunk.

The engine moves host memory, so a CUDA tensor is copied to a pinned host buffer, sent
and copied back. To overlap the copies with the network, the tensor is cut into chunks
of ``partition_bytes`` and every chunk goes through three stages of its own::

    push thread      queues the D2H copies (side stream), waits for chunk i's copy,
                     hands chunk i to the engine while chunk i+1 is still crossing PCIe
    pull thread      waits for chunk i's result, H2D copy on another stream

The caller (often autograd's thread, inside a gradient hook) only records an event on
its stream and queues the op, so backward is not slowed by staging work. Neither thread
calls the user's code, and both wait with the GIL released. The caller's stream waits
on the final H2D event at :meth:`CudaOp.wait`, so results are ordered like any other
CUDA work. Named tensors keep their pinned buffer from one step to the next.

Names: chunk 0 keeps the tensor's name, chunk i > 0 is named ``<name>.part<i>``. Every
chunk is declared with ``device="cuda"`` and a ``layout`` that says how the tensor was
cut (chunk bytes, index, count and the whole shape), so a rank that cuts differently,
or passes a CPU tensor under the same name, gets MismatchError on every rank (chunk 0
disagrees everywhere) instead of a hang. Chunks a disagreeing rank has and the others
do not stay pending in the engine (their buffers referenced) until shutdown.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Dict, List, Optional, Tuple

import torch

from bpstrain import engine
from bpstrain.engine import Op
from bpstrain.errors import BpsTimeoutError
from bpstrain.torch import _tensors


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Elements [start, stop) of the flat tensor, sent as ``name`` with ``shape``/``layout``."""

    name: str
    start: int
    stop: int
    shape: Tuple[int, ...]
    layout: str = ""


def chunk_plan(name: str, tensor: torch.Tensor, chunk_bytes: int) -> List[Chunk]:
    """How a CUDA tensor is cut for staging (the same on every rank for the same tensor)."""
    per_chunk = max(1, chunk_bytes // tensor.element_size())
    cuts = _tensors.pieces(tensor.numel(), per_chunk)
    piece_bytes = per_chunk * tensor.element_size()
    layouts = [_tensors.cut_layout("chunks", piece_bytes, i, len(cuts), tensor.shape)
               for i in range(len(cuts))]
    if len(cuts) == 1:
        return [Chunk(name, 0, cuts[0][1], tuple(tensor.shape) or (1,), layouts[0])]
    return [Chunk(name if i == 0 else f"{name}.part{i}", a, b, (b - a,), layouts[i])
            for i, (a, b) in enumerate(cuts)]


def _host_waitable_event() -> "torch.cuda.Event":
    """An event the push thread waits on from the host: blocking, so the wait sleeps.

    A default event spins a core in ``synchronize`` (CUDA's automatic schedule spins
    when there are more cores than GPUs); with several workers sharing a GPU that is a
    core per worker taken from the engine's sender threads and the kernel's network
    stack while gradients are in flight. Measured on an H100 host (16 cores, 4 emulated
    worker hosts sharing the GPU, 4 server hosts, 10 Gbit/s, VGG-16 batch 64): 291.5
    img/s with blocking events against 266.3 with default ones in one call, but 263.9
    with blocking events in the next: within the spread between calls. Kept because a
    sleeping wait frees the core at no measured cost.
    """
    return torch.cuda.Event(blocking=True)


class CudaOp:
    """One staged operation; :meth:`wait` returns the output tensor on its device."""

    def __init__(self, name, tensor, output, host, chunks, copy, ready, op, priority, root):
        self.name, self.tensor, self.output, self.host = name, tensor, output, host
        self.chunks, self.copy, self.ready = chunks, copy, ready
        self.op, self.priority, self.root = op, priority, root
        self.host_device = tensor.device
        self.handles: List[int] = []
        self.error: Optional[BaseException] = None
        self.finished: Optional[torch.cuda.Event] = None
        self.done = threading.Event()

    def poll(self) -> bool:
        """True once the result is on its way back to the device (never blocks)."""
        return self.done.is_set()

    def wait(self, timeout: float) -> torch.Tensor:
        """Blocks (GIL released, Ctrl-C works) until done; returns the output tensor."""
        waited = 0.0
        while not self.done.wait(0.1):
            waited += 0.1
            if waited >= timeout:
                raise BpsTimeoutError(
                    f"CUDA {'broadcast' if self.op == Op.BROADCAST else 'push_pull'} of "
                    f"'{self.name}' did not finish in {timeout:.0f} s "
                    f"({len(self.handles)} of {len(self.chunks)} chunks handed to the engine). "
                    "Received: timeout")
        if self.error is not None:
            raise self.error
        output, self.output = self.output, None  # the op may outlive this call (buffer cache)
        torch.cuda.current_stream(output.device).wait_event(self.finished)
        return output


class Stager:
    """The two staging threads and the per-device copy streams of this process."""

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes = int(chunk_bytes)
        self._streams: Dict[int, Tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._to_push: "queue.SimpleQueue[Optional[CudaOp]]" = queue.SimpleQueue()
        self._to_pull: "queue.SimpleQueue[Optional[CudaOp]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        # Pinned staging buffers of named tensors, reused step after step: allocating
        # pinned memory per operation costs far more than the copy itself.
        self._pinned: Dict[str, Tuple[torch.Tensor, CudaOp]] = {}
        self.cache_pinned = True
        self._threads = [threading.Thread(target=self._push_loop, name="bpstrain-cuda-push", daemon=True),
                         threading.Thread(target=self._pull_loop, name="bpstrain-cuda-pull", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _streams_of(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            if index not in self._streams:
                with torch.cuda.device(index):
                    self._streams[index] = (torch.cuda.Stream(), torch.cuda.Stream())
            return self._streams[index]

    def _host_buffer(self, name: str, tensor: torch.Tensor, reuse: bool, d2h) -> torch.Tensor:
        if not (reuse and self.cache_pinned):
            return torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True)
        host, last = self._pinned.get(name, (None, None))
        if host is None or host.numel() != tensor.numel() or host.dtype != tensor.dtype:
            return torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True)
        # The last op of this name was synchronized before this one started (as for
        # Horovod, a name is never in flight twice); its H2D copy must still finish
        # before this op's D2H copy overwrites the buffer.
        if last.finished is not None:
            d2h.wait_event(last.finished)
        return host

    def submit(self, tensor, output, name, op, priority=0, root=0, rank=0,
               reuse=False) -> CudaOp:
        """Starts the D2H copies on the caller's stream order and queues the op.

        Args:
            tensor: contiguous CUDA input (kept alive until the copies are done).
            output: contiguous CUDA tensor of the same shape for the result (may be ``tensor``).
            op: ``Op.SUM``, ``Op.AVERAGE`` or ``Op.BROADCAST``.
            reuse: keep the pinned buffer for the next op of this name (named tensors).
        """
        d2h, _ = self._streams_of(tensor.device)
        chunks = chunk_plan(name, tensor, self.chunk_bytes)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))
        host = self._host_buffer(name, tensor, reuse, d2h)
        # A non-root broadcast only receives: its input bytes are never read.
        copy = op != Op.BROADCAST or rank == root
        if copy:
            tensor.record_stream(d2h)  # op.tensor keeps it alive until the copy is queued
        staged = CudaOp(name, tensor, output, host, chunks, copy, ready, op, priority, root)
        if reuse and self.cache_pinned:
            self._pinned[name] = (host, staged)
        self._to_push.put(staged)
        return staged

    def _push_loop(self) -> None:
        # One op at a time: queueing the D2H copies of every waiting op before the first
        # one's engine hand-off was measured slower on the H200 (a ResNet-50 step's
        # exposed communication 10.5 ms vs 5.6 ms), so this stays the simple loop.
        while True:
            op = self._to_push.get()
            if op is None:
                self._to_pull.put(None)  # after everything already queued for pulling
                return
            try:
                self._hand_to_engine(op, self._copy_to_host(op))
            except BaseException as exc:  # delivered to the caller at wait()
                op.error = exc
            self._to_pull.put(op)

    def _hand_to_engine(self, op: CudaOp, events: List[Optional[torch.cuda.Event]]) -> None:
        """Starts the engine op of every chunk as soon as its D2H copy has landed."""
        dtype = _tensors.engine_dtype(op.host)
        for c, event in zip(op.chunks, events):
            if event is not None:
                event.synchronize()  # releases the GIL
            view = _tensors.host_view(op.host[c.start:c.stop], c.shape)
            # Each chunk is one partition: the engine's automatic size would cut a
            # chunk again into up to 64 KiB pieces (its rule for a tensor of a few MB
            # spread over the servers), which measured 17% slower on VGG-16 (H200).
            op.handles.append(engine.submit(c.name, dtype, c.shape, view, view, op.op, op.root,
                                            op.priority, device=op.host_device.type,
                                            layout=c.layout, partition_bytes=self.chunk_bytes))

    def _copy_to_host(self, op: CudaOp) -> List[Optional[torch.cuda.Event]]:
        """Queues the D2H copies of every chunk; returns one event per chunk."""
        d2h, _ = self._streams_of(op.host_device)
        d2h.wait_event(op.ready)
        events: List[Optional[torch.cuda.Event]] = [None] * len(op.chunks)
        with torch.cuda.stream(d2h):
            if op.copy:
                flat = op.tensor.reshape(-1)
                for i, c in enumerate(op.chunks):
                    op.host[c.start:c.stop].copy_(flat[c.start:c.stop], non_blocking=True)
                    events[i] = _host_waitable_event()
                    events[i].record(d2h)
            else:
                # Nothing to send, but the engine must not write a reused buffer before
                # the last op's H2D copy has read it.
                events[0] = _host_waitable_event()
                events[0].record(d2h)
        return events

    def _pull_loop(self) -> None:
        while True:
            op = self._to_pull.get()
            if op is None:
                return
            try:
                if op.error is None:
                    self._finish(op)
            except BaseException as exc:
                op.error = exc
            # The engine keeps failed buffers referenced itself; drop ours either way.
            op.tensor = None
            op.done.set()

    def _finish(self, op: CudaOp) -> None:
        _, h2d = self._streams_of(op.output.device)
        h2d.wait_event(op.ready)
        flat = op.output.reshape(-1)
        with torch.cuda.device(op.output.device):
            for c, h in zip(op.chunks, op.handles):
                engine.synchronize(h)
                with torch.cuda.stream(h2d):
                    flat[c.start:c.stop].copy_(op.host[c.start:c.stop], non_blocking=True)
            op.finished = torch.cuda.Event()
            op.finished.record(h2d)
        op.output.record_stream(h2d)

    def close(self) -> None:
        """Stops both threads after the queued work (idempotent)."""
        self._to_push.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
