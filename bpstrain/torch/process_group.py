"""``torch.distributed`` backend ``"bpstrain"``: c10d collectives on the push_pull engine.

    import torch
    import torch.distributed as dist
    import bpstrain.torch                       # registers the backend

    dist.init_process_group("bpstrain")         # inside `python -m bpstrain.launch ...`
    model = torch.nn.parallel.DistributedDataParallel(build_model())   # unmodified DDP
    dist.all_reduce(t)                          # SUM on the parameter servers
    dist.all_reduce(t, op=dist.ReduceOp.AVG)

What maps onto the engine, and how:

- ``all_reduce`` / ``all_reduce_coalesced``: one push_pull per tensor, ``SUM`` or
  ``AVG`` (integers: floor division). ``reduce(dst)`` is an all_reduce (every rank
  gets the result, as the servers hand it to all).
- ``broadcast``: the engine's broadcast (only the root sends data).
- ``all_gather`` / ``all_gather_into_tensor`` / ``gather``: one broadcast per rank,
  rooted at that rank (each rank sends its tensor once, receives the others).
- ``reduce_scatter`` / ``reduce_scatter_tensor``: a push_pull of the whole input, each
  rank keeping its slice (the servers have no partial pull: every rank receives all).
- ``scatter``: one broadcast per piece from the root, each rank keeping its own.
- ``barrier``: the engine's barrier.
- Anything else (``all_to_all``, ``send``/``recv``, MIN/MAX/PRODUCT/bitwise ops,
  sub-groups of some ranks) raises ``NotImplementedError`` naming the way out: a gloo
  group from the same job, ``torch.distributed.new_group(backend="gloo")``.

Names and order. The engine pairs operations across ranks by name; a collective's
name is its kind, dtype and size (``torch.distributed.0.allreduce.float32.1048576``),
used again round after round (the engine versions rounds per name), so DDP's buckets
are declared once. Every rank must issue collectives in the same order, as with any
c10d backend. Priorities: each collective outranks the ones queued before it, so DDP's
buckets, queued back to front during backward, put the front layers on the wire first
(they are the ones the next forward pass needs first).

Completion: one thread per process group waits on the engine's handles in queue order
and completes each ``Work``'s future (DDP waits on futures; its callbacks run there).
``timeout`` of ``init_process_group`` is not used; ``comm.op_timeout`` bounds each wait.
"""

from __future__ import annotations

import importlib
import itertools
import os
import queue
import socket
import threading
from typing import Callable, List, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from bpstrain import engine
from bpstrain.config.env import read_env
from bpstrain.errors import ConfigError
from bpstrain.torch import functions, ops

BACKEND = "bpstrain"
_groups = itertools.count()
_PRIORITY_WRAP = 1 << 30  # priorities stay in the engine's int range


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"the bpstrain torch.distributed backend does not offer {what}: its parameter servers sum "
        "and broadcast, they do not route point-to-point traffic or compute min/max/product. "
        "Run it on a gloo group of the same job: `g = torch.distributed.new_group(backend='gloo')`, "
        f"then pass `group=g` to that call. Received: {what}")


def _engine_op(reduce_op) -> bool:
    """True for AVG, False for SUM (the reductions the servers compute)."""
    if reduce_op == dist.ReduceOp.SUM:
        return False
    if reduce_op == dist.ReduceOp.AVG:
        return True
    kind = getattr(reduce_op, "op", reduce_op)
    raise _unsupported(f"ReduceOp.{getattr(kind, 'name', kind)}")


class _Completer:
    """Waits on engine handles in queue order and completes the futures behind them.

    DDP's reducer waits on a Work's future, not on ``Work.wait()``, so something must
    complete futures on its own: this thread (GIL released while it waits).
    """

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()

    def add(self, handles: Sequence[int], future: torch.futures.Future,
            finish: Callable[[], object]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="bpstrain-c10d", daemon=True)
                self._thread.start()
        self._queue.put((handles, future, finish))

    def close(self) -> None:
        with self._lock:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handles, future, finish = item
            error = None
            for handle in handles:  # every one, so none stays in the handle table
                try:
                    ops.synchronize(handle)
                except BaseException as exc:  # noqa: BLE001 - reported through the future
                    error = error or exc
            if error is None:
                try:
                    value = finish()
                except BaseException as exc:  # noqa: BLE001
                    error = exc
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)


class ProcessGroupBpstrain(dist.ProcessGroup):
    """A c10d ProcessGroup whose collectives are bpstrain engine operations.

    Created by ``torch.distributed.init_process_group("bpstrain")``; spans every worker
    of the job (its rank and size are the engine's).
    """

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._prefix = f"torch.distributed.{next(_groups)}"
        self._calls = itertools.count(1)
        self._completer = _Completer()

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND

    def __repr__(self) -> str:
        return f"ProcessGroupBpstrain(rank={self._rank}, size={self._size})"

    # -- plumbing ---------------------------------------------------------------------

    def _name(self, kind: str, tensor: torch.Tensor) -> str:
        return f"{self._prefix}.{kind}.{str(tensor.dtype).replace('torch.', '')}.{tensor.numel()}"

    def _priority(self) -> int:
        return next(self._calls) % _PRIORITY_WRAP

    def _work(self, handles: Sequence[int], finish: Callable[[], object]) -> dist.Work:
        future = torch.futures.Future()
        self._completer.add(list(handles), future, finish)
        return _create_work_from_future(future)

    def _push_pull(self, tensors: List[torch.Tensor], average: bool) -> List[int]:
        return [ops.push_pull_async_inplace(t, average=average, name=self._name("allreduce", t),
                                            priority=self._priority()) for t in tensors]

    def _broadcast(self, tensor: torch.Tensor, root: int) -> int:
        return ops.broadcast_async_(tensor, root, name=self._name(f"broadcast{root}", tensor),
                                    priority=self._priority())

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self._size:
            raise ValueError(f"the root rank must be in [0, {self._size}). Received: root={root}")

    # -- collectives ------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        """SUM or AVG of each tensor over all ranks, in place."""
        average = _engine_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._work(self._push_pull(list(tensors), average), lambda: list(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        """Like :meth:`allreduce` (one push_pull per tensor; the engine fuses on the wire)."""
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts=None):
        """An all_reduce: the servers hand the sum to every rank, ``dst`` included."""
        self._check_root(opts.rootRank)
        average = _engine_op(opts.reduceOp)
        return self._work(self._push_pull(list(tensors), average), lambda: list(tensors))

    def broadcast(self, tensors, opts=None):
        """Root's tensors to every rank, in place (exact)."""
        root = opts.rootRank if opts is not None else 0
        self._check_root(root)
        return self._work([self._broadcast(t, root) for t in tensors], lambda: list(tensors))

    def allgather(self, output_lists, inputs, opts=None):
        """``output_lists[i][r]`` receives rank r's ``inputs[i]``: one broadcast rooted at each rank."""
        handles = []
        for outputs, tensor in zip(output_lists, inputs):
            if len(outputs) != self._size:
                raise ValueError(f"all_gather needs one output tensor per rank ({self._size}). "
                                 f"Received: {len(outputs)} output tensors")
            for root, out in enumerate(outputs):
                if root == self._rank:
                    if out.numel() != tensor.numel():
                        raise ValueError("all_gather's output tensors must match the input's size. "
                                         f"Received: input {tuple(tensor.shape)}, output {tuple(out.shape)}")
                    out.copy_(tensor.reshape(out.shape))
                handles.append(self._broadcast(out, root))
        return self._work(handles, lambda: output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """Like :meth:`allgather`."""
        return self.allgather(output_lists, inputs, opts)

    def all_gather_single(self, output, tensor, opts=None):
        """``all_gather_into_tensor``: rank r's input lands in the r-th slice of ``output``."""
        if output.numel() != tensor.numel() * self._size:
            raise ValueError(f"all_gather_into_tensor's output must hold {self._size} inputs. "
                             f"Received: input {tuple(tensor.shape)}, output {tuple(output.shape)}")
        if not output.is_contiguous():
            raise ValueError("all_gather_into_tensor needs a contiguous output tensor. "
                             f"Received: strides {output.stride()}")
        chunks = [c.view(tensor.shape) for c in output.view(-1).chunk(self._size)]
        return self.allgather([chunks], [tensor], opts)

    _allgather_base = all_gather_single

    def gather(self, output_lists, inputs, opts=None):
        """Every rank broadcasts its input; ``dst`` keeps them (the others discard theirs)."""
        root = opts.rootRank
        self._check_root(root)
        tensor = inputs[0]
        outputs = output_lists[0] if self._rank == root else [
            torch.empty_like(tensor) for _ in range(self._size)]
        return self.allgather([outputs], [tensor])

    def scatter(self, outputs, input_lists, opts=None):
        """Root broadcasts each piece; rank r keeps piece r."""
        root = opts.rootRank
        self._check_root(root)
        out = outputs[0]
        handles, pieces = [], []
        for r in range(self._size):
            piece = input_lists[0][r].clone() if self._rank == root else torch.empty_like(out)
            pieces.append(piece)
            handles.append(self._broadcast(piece, root))

        def finish():
            out.copy_(pieces[self._rank])
            return outputs
        return self._work(handles, finish)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        """Rank r gets the reduced r-th input: one push_pull of the concatenated inputs."""
        average = _engine_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        handles, slots = [], []
        for out, pieces in zip(outputs, input_lists):
            if len(pieces) != self._size:
                raise ValueError(f"reduce_scatter needs one input tensor per rank ({self._size}). "
                                 f"Received: {len(pieces)} input tensors")
            flat = torch.cat([p.reshape(-1) for p in pieces])
            start = sum(p.numel() for p in pieces[:self._rank])
            slots.append((out, flat, start))
            handles += self._push_pull([flat], average)

        def finish():
            for out, flat, start in slots:
                out.copy_(flat[start:start + out.numel()].view_as(out))
            return outputs
        return self._work(handles, finish)

    def reduce_scatter_single(self, output, tensor, opts=None):
        """``reduce_scatter_tensor``: rank r gets the reduced r-th slice of ``tensor``."""
        if tensor.numel() != output.numel() * self._size:
            raise ValueError(f"reduce_scatter_tensor's input must hold {self._size} outputs. "
                             f"Received: input {tuple(tensor.shape)}, output {tuple(output.shape)}")
        return self.reduce_scatter([output], [list(tensor.reshape(-1).chunk(self._size))], opts)

    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts=None):
        """Blocks until every rank is here (after this group's queued collectives finish)."""
        future = torch.futures.Future()
        self._completer.add([], future, lambda: None)
        future.wait()
        engine.barrier()
        done = torch.futures.Future()
        done.set_result(None)
        return _create_work_from_future(done)

    def alltoall(self, *args, **kwargs):
        raise _unsupported("all_to_all")

    def alltoall_base(self, *args, **kwargs):
        raise _unsupported("all_to_all_single")

    def all_to_all_single(self, *args, **kwargs):
        raise _unsupported("all_to_all_single")

    def send(self, *args, **kwargs):
        raise _unsupported("send")

    def recv(self, *args, **kwargs):
        raise _unsupported("recv")

    def recv_anysource(self, *args, **kwargs):
        raise _unsupported("recv (any source)")

    def monitored_barrier(self, *args, **kwargs):
        raise _unsupported("monitored_barrier (use barrier)")

    def shutdown(self, *args, **kwargs):
        """Stops the completion thread (destroy_process_group)."""
        self._completer.close()


def _create(store, rank: int, world_size: int, timeout) -> ProcessGroupBpstrain:
    """c10d's factory: joins the bpstrain job (ops.init) and checks ranks agree."""
    del store, timeout  # the engine has its own rendezvous and op_timeout
    ops.init()
    if (rank, world_size) != (engine.rank(), engine.size()):
        if world_size != engine.size():
            raise _unsupported(f"a group of {world_size} of the job's {engine.size()} workers")
        raise ConfigError(
            "torch.distributed's rank differs from bpstrain's (rank = DMLC_WORKER_ID * "
            "BYTEPS_LOCAL_SIZE + BYTEPS_LOCAL_RANK, or torchrun's GROUP_RANK * LOCAL_WORLD_SIZE + "
            f"LOCAL_RANK). Received: torch rank={rank}, bpstrain rank={engine.rank()}")
    return ProcessGroupBpstrain(rank, world_size)


def _reachable_address(target: str) -> str:
    """This host's address toward ``target`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _bpstrain_rendezvous(url: str, timeout, **kwargs):
    """env:// inside a bpstrain job without MASTER_ADDR: ranks and size from the engine,
    a TCPStore on rank 0 whose address the engine broadcasts."""
    ops.init()
    rank, size = engine.rank(), engine.size()
    env = engine.env()
    address = None
    if rank == 0:
        host = env.node_host or _reachable_address(env.root_uri)
        store = dist.TCPStore(host, 0, size, True, timeout, wait_for_workers=False)
        address = (host, store.port)
    address = functions.broadcast_object(address, 0, name="torch.distributed.rendezvous")
    if rank != 0:
        store = dist.TCPStore(address[0], address[1], size, False, timeout)
    yield store, rank, size
    raise RuntimeError("Unable to perform re-rendezvous using env:// in a bpstrain job")


def _wrap_env_rendezvous() -> None:
    """Lets ``init_process_group`` (any backend) rendezvous inside ``bpstrain.launch``.

    torch's default ``env://`` needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a
    bpstrain worker has BytePS's variables instead. Only when MASTER_ADDR is unset in a
    bpstrain worker does the wrapper answer; otherwise torch's handler runs unchanged.
    """
    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module, not the function

    original = rdzv._rendezvous_handlers.get("env")
    if original is None or getattr(original, "_bpstrain", False):
        return

    def handler(url, timeout=None, **kwargs):
        if timeout is None:
            from torch.distributed.constants import default_pg_timeout
            timeout = default_pg_timeout
        if "MASTER_ADDR" not in os.environ and read_env().role == "worker":
            return _bpstrain_rendezvous(url, timeout, **kwargs)
        return original(url, timeout=timeout, **kwargs)

    handler._bpstrain = True
    rdzv._rendezvous_handlers["env"] = handler


def register() -> None:
    """Registers the ``"bpstrain"`` backend with torch.distributed (idempotent)."""
    if not dist.is_available():
        return
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    _wrap_env_rendezvous()
