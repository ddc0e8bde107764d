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
import contextlib
import dataclasses
import itertools
import threading
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from bpstrain._core import Op
from bpstrain.config.env import ClusterEnv, read_env
from bpstrain.config.loader import comm_options
from bpstrain.config.schema import CommConfig, aggregate_count, hierarchical_mode
from bpstrain.errors import BpsTimeoutError, ConfigError


DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "compressed")
"""The engine's dtypes; every adapter maps its own dtypes onto these names. ``compressed``
is bytes of compressed blobs (:mod:`bpstrain._codec`), pushed with Op.SUM only."""
_NUMPY_NAMES: Dict[Any, str] = {np.dtype(n): n for n in DTYPES if n not in ("bfloat16", "compressed")}
try:
    import ml_dtypes

    _NUMPY_NAMES[np.dtype(ml_dtypes.bfloat16)] = "bfloat16"
except ImportError:  # numpy alone has no bfloat16
    pass
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
        self.op_timeout = float(options["op_timeout"])
        self.worker = None  # bpstrain._core.Worker, None when standalone
        self.rank = 0
        self.size = 1
        # The one handle table of the process, shared by every adapter (as Horovod's
        # mpi_ops keeps one): handle -> (result, pending, then). ``pending`` keeps an
        # engine operation's buffers alive, is an adapter's composite operation
        # (see track()), or is None once the operation is known to be finished.
        # Engine handles are positive; standalone and composite ones negative.
        self.ops: Dict[int, tuple] = {}
        self.local_handles = itertools.count(-1, -1)
        self.unnamed = itertools.count()
        # Buffers of failed ops stay referenced: a straggling receive may still write them.
        self.graveyard: list = []
        # comm.fault_tolerance: rank/size follow the workers still in the job.
        self.fault_tolerance = False
        self.membership_epoch = 0
        self.membership_callbacks: list = []
        # Inside to_joiners() on a rank that did not just join: its broadcasts keep its own.
        self.keep_own_broadcasts = False


_state: Optional[_State] = None
_lock = threading.RLock()


def resolve_options(config: Any = None, env: Optional[ClusterEnv] = None) -> Dict[str, Any]:
    """Merges defaults < environment (BPSTRAIN_*/BYTEPS_*) < ``config``.

    One config path: the environment is read and checked by
    :mod:`bpstrain.config.env`, ``config`` by :func:`bpstrain.config.comm_options`,
    both against the bounds of the ``comm`` schema (the Trainer's own checks).

    Args:
        config: None, a dict of comm options (``secret`` too), a ``CommConfig``
            dataclass, or an OmegaConf ``DictConfig`` of the ``comm`` section.
        env: the parsed environment; read from ``os.environ`` when None.

    Raises:
        ConfigError: an unknown option (with the closest valid one), a wrong type or
            an out-of-range value.
    """
    env = env or read_env()
    options = dict(COMM_DEFAULTS)
    options.update(env.comm)
    options.update(comm_options(config))
    return options


def init(config: Any = None) -> None:
    """Joins the job described by the environment (idempotent).

    Args:
        config: comm options (see :func:`resolve_options`); env vars fill the rest.
            Checked exactly as the Trainer checks its config's ``comm`` section.

    Raises:
        ConfigError: malformed environment or options (an unknown key, a wrong type or
            an out-of-range value; the message names it and what was received).
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
            _watch_uncaught_exceptions()
        _state = state


def _connect(state: _State) -> None:
    from bpstrain import _core

    env, o = state.env, state.options
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
        hierarchical=_HIERARCHICAL_CODES[hierarchical_mode(o["hierarchical"])],
        socket_send_buffer=int(o["socket_send_buffer"]),
        advertise_host=env.node_host,
        host_id=env.host_id,
        authenticate_bodies=bool(o["authenticate_bodies"]),
        transport=str(o["transport"]),
        aggregate=aggregate_count(o["aggregate"]),
        consistency=str(o["consistency"]),
        staleness_lr=bool(o["staleness_lr"]),
        fault_tolerance=_fault_tolerance(o),
    )
    worker.start()
    try:
        while not worker.wait_ready(_WAIT_SLICE):
            pass
    except BaseException:
        worker.shutdown()
        raise
    state.worker, state.rank, state.size = worker, worker.rank, worker.size
    state.fault_tolerance = bool(o["fault_tolerance"])


def _fault_tolerance(o: Dict[str, Any]) -> bool:
    """``comm.fault_tolerance``, checked against the options it does not combine with."""
    if not bool(o["fault_tolerance"]):
        return False
    if aggregate_count(o["aggregate"]) or str(o["consistency"]) != "sync":
        raise ConfigError("comm.fault_tolerance works with synchronous training over every worker: set "
                          "comm.aggregate=all and comm.consistency=sync. Received: comm.aggregate="
                          f"{o['aggregate']!r}, comm.consistency={o['consistency']!r}")
    return True


def membership() -> Dict[str, Any]:
    """Who is in the job (``comm.fault_tolerance``): ``{"epoch": 0 until a worker
    leaves, then +1 per change, "departed": rendezvous ranks of the workers that left,
    "rank": this worker's rank among the others (what rank() says), "size": how many
    remain, "rendezvous_rank"/"rendezvous_size": this worker's rank as the scheduler gave
    it and how many ranks the job has given out (its size at the start, grown by workers
    that joined as new ranks under ``comm.max_workers``), "answered_epoch"/"answered_departed": the membership the results
    received so far were computed under, "scheduler_alive": False once the scheduler is
    gone (the job goes on, but barriers, new tensors and further membership changes
    fail), "joined": rendezvous ranks that joined at the newest :func:`admit`,
    "admitted_late": True in a worker that joined the running job, "lost_servers": servers
    that died or hung, whose partitions moved to the others}``.

    ``epoch`` changes when this rank hears from the scheduler, which two ranks may do a
    step apart; ``answered_epoch`` changes with the first result the servers computed
    without the departed workers, which every rank receives in the same step. Anything
    that must change at the same step on every rank (a data sampler's deal) follows
    ``answered_*``, read between two steps."""
    state = _require()
    if state.worker is None or not state.fault_tolerance:
        return {"epoch": 0, "departed": [], "rank": state.rank, "size": state.size,
                "rendezvous_rank": state.rank, "rendezvous_size": state.size,
                "answered_epoch": 0, "answered_departed": [], "scheduler_alive": True,
                "joined": [], "admitted_late": False, "lost_servers": []}
    m = state.worker.membership()
    return {"epoch": m["epoch"], "departed": list(m["departed"]), "rank": m["live_rank"],
            "size": m["live_size"], "rendezvous_rank": state.worker.rank,
            "rendezvous_size": state.worker.size, "answered_epoch": m["answered_epoch"],
            "answered_departed": list(m["answered_departed"]), "scheduler_alive": not m["scheduler_lost"],
            "joined": list(m["joined"]), "admitted_late": bool(m["admitted_late"]),
            "lost_servers": list(m["lost_servers"])}


def on_membership_change(callback: Callable[[Dict[str, Any]], None]) -> None:
    """Calls ``callback(membership())`` after a worker left or joined the job
    (``comm.fault_tolerance``), in the thread that next waits for an operation
    (:func:`synchronize`), before that wait returns: re-shard the data, rescale the
    learning rate, log. Callbacks run in the order they were added."""
    _require().membership_callbacks.append(callback)


def _notice_membership(state: "_State") -> None:
    """Runs the membership callbacks once per change (fault tolerance only)."""
    m = state.worker.membership()
    if m["epoch"] == state.membership_epoch:
        return
    state.membership_epoch = m["epoch"]
    state.rank, state.size = m["live_rank"], m["live_size"]
    view = membership()
    for callback in list(state.membership_callbacks):
        callback(view)


def shutdown() -> None:
    """Leaves the job (idempotent); :func:`init` may be called again afterwards."""
    _leave("")


def _leave(reason: str) -> None:
    global _state
    with _lock:
        state, _state = _state, None
    if state is not None and state.worker is not None:
        state.worker.shutdown(reason)


# Why this process is exiting, when an uncaught exception ends it (set by the hook below).
_exit_reason = ""


def _watch_uncaught_exceptions() -> None:
    """Chains ``sys.excepthook`` once, so that a worker killed by an exception tells the job.

    Its goodbye then carries the exception, and every other rank raises ``PeerError``
    naming this rank and the exception at once, instead of waiting for its part of the
    next operation until ``op_timeout`` (a clean exit still leaves quietly).
    """
    import sys

    previous = sys.excepthook
    if getattr(previous, "_bpstrain_hook", False):
        return

    def hook(exc_type, exc, tb):
        global _exit_reason
        if not _exit_reason:
            _exit_reason = f"{exc_type.__name__}: {exc}" if str(exc) else exc_type.__name__
        previous(exc_type, exc, tb)

    hook._bpstrain_hook = True
    sys.excepthook = hook


atexit.register(lambda: _leave(_exit_reason))


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _state is not None


def _require() -> _State:
    state = _state
    if state is None:
        raise ValueError("bpstrain has not been initialized; call bpstrain's init() first.")
    return state


def rank() -> int:
    """This worker's rank in [0, size()) (with ``comm.fault_tolerance``, among the workers
    still in the job)."""
    state = _require()
    if state.fault_tolerance:
        _notice_membership(state)
    return state.rank


def size() -> int:
    """Number of worker processes in the job (with ``comm.fault_tolerance``, still in it)."""
    state = _require()
    if state.fault_tolerance:
        _notice_membership(state)
    return state.size


def local_rank() -> int:
    """Rank among the workers on this host (BYTEPS_LOCAL_RANK)."""
    return _require().env.local_rank


def local_size() -> int:
    """Number of workers on this host (BYTEPS_LOCAL_SIZE)."""
    return _require().env.local_size


def env() -> ClusterEnv:
    """The cluster environment this process was started with (``DMLC_*``/``BYTEPS_*``)."""
    return _require().env


def core_worker():
    """The ``bpstrain._core.Worker`` of this process (None when standalone).

    For tools that time or inspect the raw binding (``python -m bpstrain.bench
    overhead``); operations queued on it directly bypass the handle table.
    """
    return _require().worker


def options() -> Dict[str, Any]:
    """The resolved comm options of the running engine."""
    return dict(_require().options)


def dtype_name(array: np.ndarray) -> str:
    """Maps a numpy dtype (ml_dtypes' bfloat16 included) to an engine dtype name."""
    name = _NUMPY_NAMES.get(array.dtype)
    if name is None:
        name = np.dtype(array.dtype).name
        if name not in DTYPES:
            raise ValueError(
                f"unsupported dtype; expected one of {', '.join(DTYPES)}. Received: dtype={name}")
    return name


def auto_name(kind: str) -> str:
    """The name of an unnamed tensor: ``<kind>.noname.<k>``, from one per-process counter.

    Every adapter names its unnamed calls here, so every rank must issue its unnamed
    calls in the same order (as with Horovod).
    """
    return f"{kind}.noname.{next((_state or _require()).unnamed)}"


def declare(name: str, shape, dtype: str, priority: int = 0, device: str = "cpu",
            layout: str = "") -> None:
    """Registers ``name`` with the scheduler ahead of its first use (optional).

    Every operation declares its tensor itself, so this only moves the round trip to
    the scheduler out of the first step.

    Re-declare policy: a name is not bound to one signature for good. An operation
    whose dtype, shape, ``device`` or ``layout`` differs from the name's previous use
    on this rank declares the name afresh (new keys, placed afresh), and that
    declaration is checked across ranks exactly like the first one: when the ranks
    declare it differently (other shapes, a CPU tensor here and a CUDA tensor there,
    chunks cut differently) every rank gets :class:`~bpstrain.errors.MismatchError`
    and the job stays usable. Every rank must change the name in the same step; a
    rank that keeps the old signature while another changes it waits, and both get
    :class:`~bpstrain.errors.BpsTimeoutError` after ``op_timeout``. The shared-memory
    path (``comm.hierarchical``, push_pull of workers on one host) cannot declare a
    name again with another size yet: use a new name there.

    Args:
        name: the tensor name, the same on every rank.
        shape: its dimensions.
        dtype: one of :data:`DTYPES`.
        priority: ignored (priority is per operation).
        device: where the adapter keeps the tensor (``"cpu"``, ``"cuda"``, ...).
        layout: how the adapter cut the tensor (e.g. CUDA staging chunks); compared
            as a string.
    """
    del priority  # priority is per operation
    state = _require()
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype; expected one of {', '.join(DTYPES)}. Received: dtype={dtype}")
    if state.worker is not None:
        state.worker.declare(name, dtype, [int(d) for d in shape], device, layout)


def enqueue(
    array: np.ndarray,
    name: Optional[str],
    op: Op,
    out: Optional[np.ndarray] = None,
    priority: int = 0,
    root: int = 0,
    dtype: Optional[str] = None,
    participants: int = 0,
    device: str = "cpu",
    layout: str = "",
) -> int:
    """Queues one operation on a numpy array and returns its handle (validates, then :func:`submit`).

    Args:
        array: the input; left unchanged unless ``out`` is ``array`` itself.
        name: the tensor name (``None``: :func:`auto_name`).
        op: ``Op.SUM``, ``Op.AVERAGE`` or ``Op.BROADCAST`` (0, 1, 2 are accepted).
        out: receives the result (same shape and dtype); a new array when ``None``.
        dtype: overrides the array's dtype for raw views (e.g. bfloat16 stored as uint16).
        participants: ranks taking part in this name (0 = all); the GPU hierarchical
            path uses one rank per host for each slice.
        device, layout: see :func:`declare`.
    """
    array = np.asarray(array)
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
        array = array.copy(order="C")
    dtype = dtype or dtype_name(array)
    if out is None:
        out = np.empty_like(array)
    elif out.shape != array.shape or out.dtype != array.dtype:
        raise ValueError(
            f"out must match the input's shape and dtype. Received: input {array.shape} {array.dtype}, "
            f"out {out.shape} {out.dtype}"
        )
    if not isinstance(op, Op):
        op = Op(op)
    name = name or auto_name("broadcast" if op == Op.BROADCAST else "push_pull")
    src, dst = array, out
    if dtype == "bfloat16" and array.dtype.name == "bfloat16":  # ml_dtypes exports no buffer format
        src, dst = array.view(np.uint16), out.view(np.uint16)
    return submit(name, dtype, array.shape, src, dst, op, root, priority, participants, device,
                  layout, result=out)


def submit(name: str, dtype: str, shape, src, dst, op: Op, root: int = 0, priority: int = 0,
           participants: int = 0, device: str = "cpu", layout: str = "", result: Any = None,
           then: Optional[Callable[[Any], Any]] = None,
           wrap: Optional[Callable[[Any], Any]] = None, partition_bytes: int = 0,
           **enqueue_options) -> int:
    """Low level, for adapters that validated their input: queues one operation on buffers.

    ``src``/``dst`` are C-contiguous buffers of ``shape`` (0-d: pass ``(1,)``) in
    ``dtype``; they stay referenced until the operation is over. The engine checks the
    buffer sizes and the root.

    Args:
        result: what :func:`synchronize` returns (default ``dst``).
        then: applied to the result by :func:`synchronize` (an adapter's copy-back).
        wrap: called with ``dst`` once the operation is queued, its value becoming the
            result: an adapter's conversion runs while the network works instead of
            before every rank can start.
        partition_bytes: > 0 for a piece the adapter cut itself (CUDA staging chunks):
            the engine sends it in partitions of this size instead of cutting it again.
        enqueue_options: more arguments of ``_core.Worker.enqueue``: ``pull_only``
            (k-of-n catch-up), ``param``, ``lr``, ``server_optimizer`` (server-held weights).
    """
    state = _state or _require()
    worker = state.worker
    if worker is None:
        if op == Op.BROADCAST and root != 0:
            raise ValueError(f"root_rank must be in [0, 1). Received: root_rank={root}")
        if dst is not src:
            np.copyto(dst, src)
        handle = next(state.local_handles)
        pending = None
    else:
        if state.keep_own_broadcasts and op == Op.BROADCAST:
            enqueue_options.setdefault("keep_own", True)
        handle = worker.enqueue(name, dtype, shape, src, dst, op, root, priority, participants,
                                device, layout, partition_bytes, **enqueue_options)
        pending = src, dst
    if wrap is not None:
        result = wrap(dst)
    state.ops[handle] = dst if result is None else result, pending, then
    return handle


def submit_at(name: str, dtype: str, shape, src: Any, dst: Any, nbytes: int, op: Op,
              priority: int = 0, **server_weights) -> Optional[int]:
    """The thinnest submit, for adapters whose tensors are not buffer objects (torch).

    ``src`` and ``dst`` are C-contiguous CPU tensors of ``nbytes`` bytes each with
    ``data_ptr()``; they stay referenced until the operation is over, and
    :func:`synchronize` returns ``dst``. Returns ``None`` in a standalone process (no
    engine: use :func:`submit`). ``server_weights``: as for :func:`submit`.
    """
    state = _state or _require()
    if state.worker is None:
        return None
    handle = state.worker.enqueue_at(name, dtype, shape, src.data_ptr(), dst.data_ptr(), nbytes, op,
                                     priority, **server_weights)
    state.ops[handle] = dst, (src, dst), None
    return handle


def adopt(handle: int, keep: Any, then: Callable[[Any], Any]) -> int:
    """Puts a handle of a raw ``core_worker().enqueue_*`` call in the handle table, so
    :func:`synchronize` waits for it (op timeout, errors) and returns ``then(None)``;
    ``keep`` (the op's buffers) stays referenced until then."""
    state = _state or _require()
    state.ops[handle] = None, (keep,), then
    return handle


def track(op: Any, then: Optional[Callable[[Any], Any]] = None, result: Any = None) -> int:
    """Gives an adapter's own operation a handle in the engine's one handle table.

    Args:
        op: has ``poll() -> bool`` (never blocks) and ``wait(timeout) -> value`` (GIL
            released, Ctrl-C honoured), e.g. a staged CUDA push_pull whose chunks are
            engine operations of their own; ``None``: already finished.
        then: applied to the result by :func:`synchronize`.
        result: what :func:`synchronize` returns (default: ``op.wait()``'s value).
    """
    state = _state or _require()
    handle = next(state.local_handles)
    state.ops[handle] = result, op, then
    return handle


def push_pull_async(array, name=None, average=True, priority=0, out=None, dtype=None) -> int:
    """Starts summing (or averaging) ``array`` over all ranks; returns a handle."""
    return enqueue(array, name, Op.AVERAGE if average else Op.SUM, out, priority, dtype=dtype)


def _entry(state: _State, handle: int) -> tuple:
    try:
        return state.ops[handle]
    except (KeyError, TypeError):
        raise ValueError(f"unknown handle (already synchronized?). Received: handle={handle!r}") from None


def poll(handle: int) -> bool:
    """True when the operation behind ``handle`` has finished (never blocks)."""
    state = _state or _require()
    result, pending, then = _entry(state, handle)
    if pending is None:
        return True
    if handle < 0:  # an adapter's composite operation
        return pending.poll()
    try:
        done = state.worker.poll(handle)
    except BaseException as exc:
        _bury(state, handle, exc)
        raise
    if done:  # the engine forgot the handle; remember the result for synchronize()
        state.ops[handle] = result, None, then
    return done


def _bury(state: _State, handle: int, exc: BaseException) -> None:
    """Forgets a failed operation; its buffers stay referenced (a straggling receive
    may still write them). After Ctrl-C the operation stays: synchronize() again."""
    if not isinstance(exc, KeyboardInterrupt):
        state.graveyard.append(state.ops.pop(handle, None))


def synchronize(handle: int, timeout: Optional[float] = None) -> Any:
    """Waits for ``handle`` and returns its output (an array; an adapter's tensor).

    Args:
        handle: from any ``*_async`` call of the engine or an adapter.
        timeout: seconds; defaults to the ``op_timeout`` option (300 s).

    Raises:
        MismatchError: ranks disagree on the tensor's shape, dtype, device or layout.
        PeerError: a worker or server died.
        BpsTimeoutError: not done within ``timeout``; says what it still waits for (the
            operation stays pending: synchronize it again or shut down).
    """
    state = _state or _require()
    result, pending, then = _entry(state, handle)
    if pending is not None:
        limit = state.op_timeout if timeout is None else float(timeout)
        try:
            if handle < 0:
                value = pending.wait(limit)
                result = value if result is None else result
            elif not state.worker.wait(handle, _WAIT_SLICE):
                _wait_longer(state, handle, limit)
        except BaseException as exc:
            if not isinstance(exc, BpsTimeoutError):
                _bury(state, handle, exc)
            raise
    del state.ops[handle]
    if state.fault_tolerance:
        _notice_membership(state)
    return result if then is None else then(result)


def _wait_longer(state: _State, handle: int, limit: float) -> None:
    waited = _WAIT_SLICE
    while not state.worker.wait(handle, _WAIT_SLICE):
        waited += _WAIT_SLICE
        if waited >= limit:
            raise BpsTimeoutError(
                f"{state.worker.describe(handle)}; gave up after {limit:.0f} s. Raise the limit with "
                "comm.op_timeout / BPSTRAIN_OP_TIMEOUT if a rank is legitimately slow."
            )


def push_pull(array, name=None, average=True, priority=0, out=None, dtype=None) -> np.ndarray:
    """Sums (``average=False``) or averages ``array`` over all ranks; blocking."""
    return synchronize(enqueue(array, name, Op.AVERAGE if average else Op.SUM, out, priority,
                               dtype=dtype))


def broadcast_async(array, root_rank: int, name=None, out=None, dtype=None, priority=0) -> int:
    """Starts sending ``root_rank``'s ``array`` to every rank; returns a handle."""
    return enqueue(array, name, Op.BROADCAST, out, priority, root=root_rank, dtype=dtype)


def broadcast(array, root_rank: int, name=None, out=None, dtype=None) -> np.ndarray:
    """Returns ``root_rank``'s ``array`` on every rank (exact; only the root sends data)."""
    return synchronize(broadcast_async(array, root_rank, name, out, dtype))


def broadcast_bytes(payload: Optional[bytes], root_rank: int, name: str) -> Optional[bytes]:
    """Returns ``root_rank``'s ``payload`` on every rank (the others pass None): its
    length, then its bytes, as two broadcasts named ``<name>.length``/``<name>.payload``.
    The adapters' ``broadcast_object`` send their pickles through it. Inside
    :func:`to_joiners`, a rank that keeps its own gets its own ``payload`` back (None
    on the ranks other than the root)."""
    mine = rank() == root_rank
    data = np.frombuffer(payload, np.uint8).copy() if mine else np.zeros(0, np.uint8)
    length = np.array([data.size], np.int64)
    keeps_own = _state is not None and _state.keep_own_broadcasts
    with to_all():  # every rank needs the length: the payload's shape is declared
        broadcast(length, root_rank, f"{name}.length", out=length)
    if not mine:
        data = np.zeros(int(length[0]), np.uint8)
    broadcast(data, root_rank, f"{name}.payload", out=data)
    return payload if mine or keeps_own else data.tobytes()


@contextlib.contextmanager
def to_joiners():
    """Broadcasts started inside reach only the workers that joined at the newest
    :func:`admit` (``comm.fault_tolerance``). Every other rank, the :func:`sync_root`
    included, takes part in each round but receives no bytes: its result is its own
    input. The workers already in a synchronous job hold the root's weights and
    optimizer state, so sending a joiner the state costs the servers one download per
    joiner instead of one per worker (VGG-16 with momentum: 1 GB per worker). Enter it
    on every rank at the same point, with the same broadcasts inside; after an admission
    that let nobody in, or in a single process, it changes nothing. Not for values that
    differ between the workers in the job: broadcast those outside it, or in
    :func:`to_all`."""
    state = _require()
    if state.worker is None or state.keep_own_broadcasts:
        yield
        return
    m = membership()
    state.keep_own_broadcasts = bool(m["joined"]) and m["rendezvous_rank"] not in m["joined"]
    try:
        yield
    finally:
        state.keep_own_broadcasts = False


@contextlib.contextmanager
def to_all():
    """Inside :func:`to_joiners`: broadcasts that every rank receives again, for what
    only the root knows (the length of a payload, which state an optimizer has)."""
    state = _require()
    kept, state.keep_own_broadcasts = state.keep_own_broadcasts, False
    try:
        yield
    finally:
        state.keep_own_broadcasts = kept


def barrier(timeout: Optional[float] = None) -> None:
    """Blocks until every rank has called :func:`barrier`."""
    state = _require()
    if state.worker is None:
        return
    handle = state.worker.enqueue_barrier()
    state.ops[handle] = None, (), None
    synchronize(handle, timeout)


def admit(timeout: Optional[float] = None) -> List[int]:
    """Lets waiting workers join the job (``comm.fault_tolerance``); call between steps.

    Every worker in the job calls it at the same step (``bpstrain.torch.elastic``'s
    ``state.commit()`` does). A worker process started after the rendezvous (a restart
    by ``python -m bpstrain.launch --max-restarts``, or a hand-started ``DMLC_ROLE=worker``)
    waits in its ``init()`` until then; it joins here, in the place of a departed worker
    or, with none free, as a new rank while the job has fewer than ``comm.max_workers``
    (scale-up), and its gradients count from the next step.
    The joiners get no state from the engine: the caller sends them the model and the
    optimizer (``state.sync()``). Without fault tolerance nobody can join: returns [].

    Returns:
        The rendezvous ranks that joined (the same list on every rank; [] when none).

    Raises:
        ConfigError: an operation of this worker is still running (synchronize it first).
        PeerError: the scheduler is gone (joins need it).
    """
    state = _require()
    if state.worker is None or not state.fault_tolerance:
        return []
    handle = state.worker.enqueue_admission()
    state.ops[handle] = None, (), None
    synchronize(handle, timeout)
    return list(state.worker.membership()["joined"])


def sync_root() -> int:
    """The rank (as :func:`rank` numbers the workers in the job) whose state the workers
    that joined at the newest :func:`admit` receive: the lowest rank that was in the job
    before it (0 without fault tolerance or before any join). The same on every rank."""
    m = membership()
    departed, joined = set(m["departed"]), set(m["joined"])
    stayed = [r for r in range(m["rendezvous_size"]) if r not in departed and r not in joined]
    if not stayed:  # everyone joined at once (cannot happen: admissions need the job's workers)
        return 0
    return stayed[0] - sum(1 for r in departed if r < stayed[0])


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


def rounds_behind(name: str) -> int:
    """Under k-of-n aggregation (``comm.aggregate=k:<K>``): how many rounds of ``name`` the
    servers already answered that this worker has not started (0 when it keeps up, the
    name is unknown, or the job is synchronous). A worker that fell behind takes those
    answers with ``core_worker().enqueue(..., pull_only=True)`` instead of computing them."""
    state = _require()
    return state.worker.rounds_behind(name) if state.worker is not None else 0


def stats() -> Dict[str, float]:
    """Bytes pushed/pulled and partitions completed by this worker so far, and the link
    measured at rendezvous (``link_bytes_per_s``, ``link_rtt_s``; 0 when not measured)."""
    state = _require()
    return state.worker.stats() if state.worker is not None else {}
