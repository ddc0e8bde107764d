"""push_pull, broadcast and the Gluon kvstore on MXNet NDArrays, over :mod:`bpstrain.engine`.

Every operation here is synchronous and in place: the NDArrays' values are read (a
zero-copy DLPack view on CPU, ``asnumpy()`` on other devices), exchanged through
:mod:`bpstrain._group` as one engine group (every tensor enqueued before any is waited
for), and the results are copied back into the NDArrays. MXNet's own asynchronous
engine is never left with pending writes: reading the values waits for them.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from bpstrain import _group, engine
from bpstrain.mxnet._compat import import_mxnet

mx = import_mxnet()


class _Capsule:
    """Hands an MXNet DLPack capsule to ``numpy.from_dlpack`` (which wants the protocol)."""

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, stream=None):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def host_array(value) -> np.ndarray:
    """The values of NDArray ``value`` as numpy: a read-only view on CPU, else a copy.

    Both wait until MXNet has finished writing ``value``.
    """
    if value.context.device_type == "cpu" and value.stype == "default":
        return np.from_dlpack(_Capsule(value.to_dlpack_for_read()))
    return value.asnumpy()


def exchange(kind: str, values: Sequence, names: Sequence[str], average: bool = True,
             root_rank: int = 0, priorities: Optional[Sequence[int]] = None) -> List[np.ndarray]:
    """push_pulls (``kind="push_pull"``) or broadcasts NDArrays as one engine group.

    Returns new numpy arrays in input order; ``values`` are left unchanged.
    """
    arrays = [host_array(v) for v in values]
    if kind == "push_pull":
        return _group.push_pull_group(arrays, names, average, priorities)
    return _group.broadcast_group(arrays, names, root_rank, priorities)


def write(outs: Sequence[Sequence], results: Sequence[np.ndarray]) -> None:
    """Copies each result into every NDArray of its list (one per device)."""
    for targets, result in zip(outs, results):
        for target in targets:
            target[:] = result


def push_pull(tensor, version: int = 0, priority: int = 0, name: Optional[str] = None,
              is_average: bool = True):
    """Sums (``is_average=False``) or averages NDArray ``tensor`` over all ranks, in place.

    BytePS's ``byteps_push_pull`` signature; blocking, and returns ``tensor``.

    Args:
        tensor: an NDArray of float16, float32, float64, uint8, int8, int32 or int64.
        version: ignored (BytePS's argument, kept for its scripts).
        priority: larger is sent sooner.
        name: the engine name, the same on every rank; unnamed calls are numbered in
            call order (:func:`bpstrain.engine.auto_name`), so every rank must issue
            them in the same order.
    """
    del version
    name = name or engine.auto_name("mx.push_pull")
    write([[tensor]], exchange("push_pull", [tensor], [name], is_average, priorities=[priority]))
    return tensor


def broadcast(tensor, root_rank: int = 0, name: Optional[str] = None, priority: int = 0):
    """Overwrites NDArray ``tensor`` with ``root_rank``'s value (exact), in place; returns it."""
    name = name or engine.auto_name("mx.broadcast")
    write([[tensor]], exchange("broadcast", [tensor], [name], root_rank=root_rank,
                               priorities=[priority]))
    return tensor


def broadcast_parameters(params, root_rank: int = 0, prefix: Optional[str] = None) -> None:
    """Gives every rank ``root_rank``'s parameters, in place (one engine group).

    Args:
        params: a dict of name -> NDArray (``Module.get_params()``'s dicts, as in
            BytePS), or a Gluon ``ParameterDict`` (``net.collect_params()``) whose
            parameters are initialized (every device's copy is overwritten).
        root_rank: the rank whose values everyone receives.
        prefix: engine name prefix, the same on every rank (default: numbered in call
            order, so every rank must call in the same order).

    Raises:
        ValueError: ``params`` is neither, or a Gluon parameter is not initialized yet
            (deferred initialization: run one forward pass first, or let
            :class:`DistributedTrainer` broadcast it at its first step).
    """
    if isinstance(params, mx.gluon.ParameterDict):
        keys = sorted(params.keys())
        outs = [_initialized_data(params[k]) for k in keys]
    elif isinstance(params, dict):
        keys = sorted(params)
        outs = [[params[k]] for k in keys]
    else:
        raise ValueError("broadcast_parameters takes a dict of NDArrays or a gluon "
                         f"ParameterDict. Received: {type(params).__name__}")
    prefix = prefix or engine.auto_name("mx.broadcast_parameters")
    results = exchange("broadcast", [o[0] for o in outs], [f"{prefix}.{k}" for k in keys],
                       root_rank=root_rank)
    write(outs, results)


def _initialized_data(param) -> list:
    try:
        return param.list_data()
    except mx.gluon.parameter.DeferredInitializationError:
        raise ValueError(
            f"parameter {param.name} is not initialized yet (deferred initialization): run "
            "one forward pass before broadcast_parameters, or train with "
            "bpstrain.mxnet.DistributedTrainer, which broadcasts at its first step. "
            f"Received: shape {param.shape}") from None


class KVStore(mx.kvstore.KVStoreBase):
    """A kvstore for ``gluon.Trainer(kvstore=...)`` that moves values through bpstrain.

    ::

        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                kvstore=bps.KVStore(), update_on_kvstore=False)
        trainer.step(batch_size * bps.size())   # gradients are summed over the ranks

    ``pushpull`` sums over ranks (and over the devices of each rank), as MXNet's
    ``dist_sync`` kvstore does; ``KVStore(average=True)`` averages instead, so that
    ``trainer.step(batch_size)`` with the per-worker batch equals one process with
    the whole batch (what :class:`DistributedTrainer` does). ``broadcast`` sends
    ``root_rank``'s value: the Trainer broadcasts every parameter at its first step.
    The optimizer always runs on the workers (``update_on_kvstore`` is False whatever
    is asked: the parameter servers only sum).

    Args:
        average: average over ranks instead of summing.
        root_rank: the rank whose values :meth:`broadcast` sends.
        name: engine name prefix, the same on every rank (default: numbered in creation
            order, so every rank must create its kvstores in the same order).
    """

    def __init__(self, average: bool = False, root_rank: int = 0, name: Optional[str] = None):
        self._average = bool(average)
        self.root_rank = int(root_rank)
        self._prefix = name or engine.auto_name("mx.kvstore")

    def _run(self, kind, key, value, out, priority):
        keys, values = _by_key(key, value)
        outs = values if out is None else _by_key(key, out)[1]
        if kind == "push_pull":
            sources = [vs[0] if len(vs) == 1 else _local_sum(vs) for vs in values]
        else:
            sources = [vs[0] for vs in values]
        results = exchange(kind, sources, [f"{self._prefix}.{k}" for k in keys],
                           average=self._average, root_rank=self.root_rank,
                           priorities=[int(priority) - i for i in range(len(keys))])
        write(outs, results)

    def broadcast(self, key, value, out, priority=0):
        """Writes ``root_rank``'s ``value`` into ``out`` on every rank.

        ``key`` may be a list of keys (with lists of values and outs): one group,
        the first key sent first.
        """
        self._run("broadcast", key, value, out, priority)

    def pushpull(self, key, value, out=None, priority=0):
        """Sums (or averages) ``value`` over devices and ranks into ``out`` (default ``value``).

        ``value`` may be one NDArray or a list (one per device) per key; ``key`` may be
        a list of keys: one group, the first key sent first (``priority - index``).
        """
        self._run("push_pull", key, value, out, priority)

    @staticmethod
    def is_capable(capability):
        if capability.lower() == mx.kvstore.KVStoreBase.OPTIMIZER:
            return False  # the servers sum; the optimizer runs on the workers
        raise ValueError(f"Unknown capability: {capability}")

    def set_optimizer(self, optimizer):
        raise NotImplementedError("the bpstrain kvstore runs no optimizer (update_on_kvstore "
                                  "is False): gluon.Trainer updates on the workers")

    def save_optimizer_states(self, fname, dump_optimizer=False):
        raise NotImplementedError("the bpstrain kvstore holds no optimizer state; "
                                  "use gluon.Trainer.save_states")

    def load_optimizer_states(self, fname):
        raise NotImplementedError("the bpstrain kvstore holds no optimizer state; "
                                  "use gluon.Trainer.load_states")

    @property
    def type(self):
        return "bpstrain"

    @property
    def rank(self):
        return engine.rank()

    @property
    def num_workers(self):
        return engine.size()


def _by_key(key, value):
    """(keys, [list of NDArrays per key]) from MXNet's key/value conventions."""
    if isinstance(key, (list, tuple)):
        count = len(value) if isinstance(value, (list, tuple)) else 1
        if count != len(key):
            raise ValueError(f"expected one value per key ({len(key)}). Received: {count}")
        return list(key), [list(v) if isinstance(v, (list, tuple)) else [v] for v in value]
    return [key], [list(value) if isinstance(value, (list, tuple)) else [value]]


def _local_sum(values):
    ctx = values[0].context
    total = values[0].copy()
    for v in values[1:]:
        total += v.as_in_context(ctx)
    return total
