"""Framework-neutral facade of the push_pull engine (numpy arrays / buffer protocol).

Every adapter (:mod:`bpstrain.torch`, :mod:`bpstrain.tensorflow`, :mod:`bpstrain.keras`)
sits on these calls. Typical use inside a launched job::

    import numpy as np
    import bpstrain.engine as bps

    bps.init()                                    # reads DMLC_* / BYTEPS_* env vars
    total = bps.push_pull(np.ones(4, np.float32), name="x", average=False)
    bps.shutdown()

Without ``DMLC_ROLE`` in the environment the process runs standalone (rank 0 of 1,
nothing leaves the process), so scripts and notebooks work unchanged on one process.
Every wait releases the GIL in slices, so Ctrl-C interrupts it, and has a timeout.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import threading
from typing import Any, Dict, Optional, Tuple

import numpy as np

from bpstrain.config.env import ClusterEnv, read_env
from bpstrain.config.schema import CommConfig, hierarchical_mode
from bpstrain.errors import BpsTimeoutError, ConfigError

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
_OP_SUM, _OP_AVERAGE, _OP_BROADCAST = 0, 1, 2
_WAIT_SLICE = 0.1  # seconds per GIL-free wait; bounds Ctrl-C latency
_HIERARCHICAL_CODES = {"false": 0, "true": 1, "auto": 2}  # WorkerOptions::Hierarchical

# The comm options the engine reads, with their defaults: CommConfig is the one
# source; the cluster secret travels with them.
COMM_DEFAULTS: Dict[str, Any] = {**dataclasses.asdict(CommConfig()), "secret": ""}


class _State:
    """Everything init() creates; replaced wholesale so init() can run again."""

    def __init__(self, env: ClusterEnv, options: Dict[str, Any]):
        self.env = env
        self.options = options
        self.worker = None  # bpstrain._core.Worker, None when standalone
        self.rank = 0
        self.size = 1
        self.ops: Dict[int, Tuple[str, Any, np.ndarray]] = {}  # handle -> (name, input, output)
        self.local_handles = itertools.count(-1, -1)  # standalone handles are negative
        self.done_local: Dict[int, np.ndarray] = {}
        self.unnamed = itertools.count()
        # Buffers of failed ops stay referenced: a straggling receive may still write them.
        self.graveyard: list = []


_state: Optional[_State] = None
_lock = threading.RLock()


def resolve_options(config: Any = None, env: Optional[ClusterEnv] = None) -> Dict[str, Any]:
    """Merges defaults < environment (BPSTRAIN_*/BYTEPS_*) < ``config``.

    Args:
        config: None, a dict of comm options, a ``CommConfig`` dataclass, or an
            OmegaConf ``DictConfig`` of the ``comm`` section.
        env: the parsed environment; read from ``os.environ`` when None.

    Raises:
        ConfigError: an unknown option name (with the closest valid one).
    """
    env = env or read_env()
    options = dict(COMM_DEFAULTS)
    options.update(env.comm)
    if config is None:
        return options
    if dataclasses.is_dataclass(config):
        given = dataclasses.asdict(config)
    elif hasattr(config, "items"):
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(config, DictConfig):
                config = OmegaConf.to_container(config, resolve=True)
        except ImportError:
            pass
        given = dict(config)
    else:
        raise ConfigError(
            f"init(config=...) takes a dict, CommConfig or DictConfig. Received: {type(config).__name__}"
        )
    for key, value in given.items():
        if key not in COMM_DEFAULTS:
            import difflib

            close = difflib.get_close_matches(key, COMM_DEFAULTS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown comm option {key!r}.{hint} Received: {key}={value!r}")
        options[key] = value
    return options


def init(config: Any = None) -> None:
    """Joins the job described by the environment (idempotent).

    Args:
        config: comm options (see :func:`resolve_options`); env vars fill the rest.

    Raises:
        ConfigError: malformed environment or options.
        BpsTimeoutError: the rendezvous did not complete in ``rendezvous_timeout``.
        KeyboardInterrupt: Ctrl-C during the rendezvous (nothing is left running).
    """
    global _state
    with _lock:
        if _state is not None:
            return
        env = read_env()
        if env.role not in (None, "worker"):
            raise ConfigError(
                f"init() runs in worker processes; DMLC_ROLE={env.role} processes are started with "
                "`python -m bpstrain.launch`. Received: DMLC_ROLE=" + str(env.role)
            )
        state = _State(env, resolve_options(config, env))
        if env.distributed:
            _connect(state)
        _state = state


def _connect(state: _State) -> None:
    from bpstrain import _core

    env, o = state.env, state.options
    hierarchical = hierarchical_mode(o["hierarchical"])
    if not hierarchical:
        raise ConfigError("comm.hierarchical must be one of auto, true, false. "
                          f"Received: hierarchical={o['hierarchical']!r}")
    worker = _core.Worker(
        env.root_uri,
        env.root_port,
        rank_hint=env.rank_hint,
        local_rank=env.local_rank,
        local_size=env.local_size,
        partition_bytes=int(o["partition_bytes"]),
        credit_bytes=int(o["credit_bytes"]),
        connections_per_server=int(o["connections_per_server"]),
        priority=bool(o["priority"]),
        numa=str(o["numa"]),
        rendezvous_timeout=float(o["rendezvous_timeout"]),
        secret=str(o["secret"] or ""),
        hierarchical=_HIERARCHICAL_CODES[hierarchical],
        socket_send_buffer=int(o["socket_send_buffer"]),
        advertise_host=env.node_host,
        host_id=env.host_id,
    )
    worker.start()
    try:
        while not worker.wait_ready(_WAIT_SLICE):
            pass
    except BaseException:
        worker.shutdown()
        raise
    state.worker, state.rank, state.size = worker, worker.rank, worker.size


def shutdown() -> None:
    """Leaves the job (idempotent); :func:`init` may be called again afterwards."""
    global _state
    with _lock:
        state, _state = _state, None
    if state is not None and state.worker is not None:
        state.worker.shutdown()


atexit.register(shutdown)


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _state is not None


def _require() -> _State:
    state = _state
    if state is None:
        raise ValueError("bpstrain has not been initialized; call bpstrain's init() first.")
    return state


def rank() -> int:
    """This worker's rank in [0, size())."""
    return _require().rank


def size() -> int:
    """Number of worker processes in the job."""
    return _require().size


def local_rank() -> int:
    """Rank among the workers on this host (BYTEPS_LOCAL_RANK)."""
    return _require().env.local_rank


def local_size() -> int:
    """Number of workers on this host (BYTEPS_LOCAL_SIZE)."""
    return _require().env.local_size


def options() -> Dict[str, Any]:
    """The resolved comm options of the running engine."""
    return dict(_require().options)


def dtype_name(array: np.ndarray) -> str:
    """Maps a numpy dtype (ml_dtypes' bfloat16 included) to an engine dtype name."""
    name = np.dtype(array.dtype).name
    if name not in DTYPES:
        raise ValueError(
            f"unsupported dtype; expected one of {', '.join(DTYPES)}. Received: dtype={name}"
        )
    return name


def _auto_name(state: _State, kind: str) -> str:
    # Unnamed tensors get names from a per-process counter: every rank must issue its
    # unnamed calls in the same order (as with Horovod).
    return f"{kind}.noname.{next(state.unnamed)}"


def declare(name: str, shape, dtype: str, priority: int = 0) -> None:
    """Registers ``name`` with the scheduler ahead of its first use (optional)."""
    del priority  # priority is per operation
    state = _require()
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype; expected one of {', '.join(DTYPES)}. Received: dtype={dtype}")
    if state.worker is not None:
        state.worker.declare(name, dtype, [int(d) for d in shape])


def enqueue(
    array: np.ndarray,
    name: Optional[str],
    op: int,
    out: Optional[np.ndarray] = None,
    priority: int = 0,
    root: int = 0,
    dtype: Optional[str] = None,
    participants: int = 0,
) -> int:
    """Low-level: queues one operation on ``array`` and returns its handle.

    ``dtype`` overrides the array's dtype for raw views (e.g. bfloat16 stored as
    uint16). ``out`` receives the result (it may be ``array`` itself).
    ``participants`` is the number of ranks that take part in this name (0 = all);
    the GPU hierarchical path uses one rank per host for each slice.
    """
    state = _require()
    array = np.asarray(array)
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
        array = array.copy(order="C")
    dtype = dtype or dtype_name(array)
    if out is None:
        out = np.empty_like(array)
    if out.shape != array.shape or out.dtype != array.dtype:
        raise ValueError(
            f"out must match the input's shape and dtype. Received: input {array.shape} {array.dtype}, "
            f"out {out.shape} {out.dtype}"
        )
    name = name or _auto_name(state, "broadcast" if op == _OP_BROADCAST else "push_pull")
    if state.worker is None:
        if op == _OP_BROADCAST and root != 0:
            raise ValueError(f"broadcast root must be in [0, 1). Received: root_rank={root}")
        if out is not array:
            np.copyto(out, array)
        handle = next(state.local_handles)
        state.done_local[handle] = out
        return handle
    src, dst = array, out
    if array.dtype.name == "bfloat16":  # ml_dtypes arrays export no buffer format
        src, dst = array.view(np.uint16), out.view(np.uint16)
    handle = state.worker.enqueue(name, dtype, list(array.shape), src, dst, op, root, priority,
                                  participants)
    state.ops[handle] = (name, array, out)
    return handle


def push_pull_async(array, name=None, average=True, priority=0, out=None, dtype=None) -> int:
    """Starts summing (or averaging) ``array`` over all ranks; returns a handle."""
    return enqueue(array, name, _OP_AVERAGE if average else _OP_SUM, out, priority, dtype=dtype)


def poll(handle: int) -> bool:
    """True when the operation behind ``handle`` has finished (never blocks)."""
    state = _require()
    if handle < 0:
        return True
    if handle not in state.ops:
        raise ValueError(f"unknown handle {handle} (already synchronized?)")
    return _finish_if(state, handle, lambda: state.worker.poll(handle), consume=False)


def _finish_if(state: _State, handle: int, check, consume: bool) -> bool:
    try:
        done = check()
    except BaseException as exc:
        if not isinstance(exc, KeyboardInterrupt):
            state.graveyard.append(state.ops.pop(handle, None))
        raise
    if done and not consume:
        # The engine forgot the handle; remember the result for synchronize().
        state.done_local[handle] = state.ops.pop(handle)[2]
    return done


def synchronize(handle: int, timeout: Optional[float] = None) -> np.ndarray:
    """Waits for ``handle`` and returns its output array.

    Args:
        handle: from :func:`push_pull_async` or :func:`broadcast_async`.
        timeout: seconds; defaults to the ``op_timeout`` option (300 s).

    Raises:
        MismatchError: ranks disagree on the tensor's shape or dtype.
        PeerError: a worker or server died.
        BpsTimeoutError: not done within ``timeout``; says what it still waits for.
    """
    state = _require()
    if handle in state.done_local:
        return state.done_local.pop(handle)
    if handle not in state.ops:
        raise ValueError(f"unknown handle {handle} (already synchronized?)")
    limit = float(state.options["op_timeout"] if timeout is None else timeout)
    waited = 0.0
    while not _finish_if(state, handle, lambda: state.worker.wait(handle, _WAIT_SLICE), consume=True):
        waited += _WAIT_SLICE
        if waited >= limit:
            raise BpsTimeoutError(
                f"{state.worker.describe(handle)}; gave up after {limit:.0f} s. Raise the limit with "
                "comm.op_timeout / BPSTRAIN_OP_TIMEOUT if a rank is legitimately slow."
            )
    return state.ops.pop(handle)[2]


def push_pull(array, name=None, average=True, priority=0, out=None, dtype=None) -> np.ndarray:
    """Sums (``average=False``) or averages ``array`` over all ranks; blocking."""
    return synchronize(push_pull_async(array, name, average, priority, out, dtype))


def broadcast_async(array, root_rank: int, name=None, out=None, dtype=None, priority=0) -> int:
    """Starts sending ``root_rank``'s ``array`` to every rank; returns a handle."""
    return enqueue(array, name, _OP_BROADCAST, out, priority, root=root_rank, dtype=dtype)


def broadcast(array, root_rank: int, name=None, out=None, dtype=None) -> np.ndarray:
    """Returns ``root_rank``'s ``array`` on every rank (exact; only the root sends data)."""
    return synchronize(broadcast_async(array, root_rank, name, out, dtype))


def barrier(timeout: Optional[float] = None) -> None:
    """Blocks until every rank has called :func:`barrier`."""
    state = _require()
    if state.worker is None:
        return
    handle = state.worker.enqueue_barrier()
    state.ops[handle] = ("<barrier>", None, None)
    synchronize(handle, timeout)


def set_trace(on: bool) -> None:
    """Starts/stops recording the push and pull phase of every operation (timeline)."""
    state = _require()
    if state.worker is not None:
        state.worker.set_trace(bool(on))


def drain_trace() -> list:
    """Phase records of operations finished since the last call: dicts with ``name``,
    ``op``, ``bytes`` and wall-clock microseconds ``enqueued_us``, ``push_begin_us``,
    ``push_end_us``, ``pull_begin_us``, ``done_us``. Empty when standalone."""
    state = _require()
    return state.worker.drain_trace() if state.worker is not None else []


def stats() -> Dict[str, int]:
    """Bytes pushed/pulled and partitions completed by this worker so far."""
    state = _require()
    return state.worker.stats() if state.worker is not None else {}
