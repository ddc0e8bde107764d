"""push_pull and broadcast as TensorFlow operations: eager, inside tf.function, differentiable.

Eagerly the engine is called directly on the tensors' numpy values. Inside a
``tf.function`` the same calls run in one ``tf.numpy_function`` per group; such ops
are stateful, so TensorFlow's automatic control dependencies run them in program
order on every rank. XLA cannot compile them (see :func:`check_not_xla`).

Errors: eagerly the engine's exceptions come through unchanged (a cross-rank shape
or dtype disagreement is ``bpstrain.errors.MismatchError``, a ``RuntimeError``).
Inside a ``tf.function`` TensorFlow turns them into ``tf.errors.UnknownError`` whose
message starts with ``MismatchError: tensor '...' disagrees across ranks``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import tensorflow as tf

from bpstrain import _group, engine
from bpstrain.engine import Op
from bpstrain.tensorflow.compression import (Compression, check_compression, for_push_pull,
                                             is_stateful)

Average = Op.AVERAGE
"""``op=Average``: the mean over all ranks (Horovod's ``hvd.Average``)."""
Sum = Op.SUM
"""``op=Sum``: the sum over all ranks (Horovod's ``hvd.Sum``)."""


def resolve_average(average: Optional[bool], op) -> bool:
    """Horovod's ``average=``/``op=`` pair as one bool (True: average, the default).

    Raises:
        ValueError: both are given, or ``op`` is neither ``Average`` nor ``Sum``
            (Adasum, Min, Max and Product do not map onto the parameter servers).
    """
    if op is None:
        return True if average is None else bool(average)
    if average is not None:
        raise ValueError("pass op= or average=, not both (op supersedes the deprecated "
                         f"average). Received: average={average!r}, op={op!r}")
    if op is Op.AVERAGE or op is Op.SUM:
        return op is Op.AVERAGE
    raise ValueError("op must be bpstrain.tensorflow.Average or Sum (the parameter servers "
                     "sum; Adasum, Min, Max and Product are not offered: reduce with Sum "
                     f"and post-process, or use Average). Received: op={op!r}")

def tensor_name(kind: str, tensor, name: Optional[str]) -> str:
    """The engine name of ``tensor``: ``name``, or one every rank derives alike.

    Inside a ``tf.function`` the name comes from the function and the graph tensor
    (``tf.push_pull.train_step/dense/MatMul:0``), fixed at trace time. Eager tensors
    have no name: they are numbered in call order by :func:`bpstrain.engine.auto_name`,
    as in Horovod, so every rank must issue its unnamed calls in the same order.
    """
    if name:
        return name
    graph_name = getattr(getattr(tensor, "graph", None), "name", None)
    if tf.executing_eagerly() or not graph_name:
        return engine.auto_name(f"tf.{kind}")
    return f"tf.{kind}.{graph_name}/{tensor.name}"


def variable_name(variable) -> str:
    """Keras variables' ``path`` (``dense/kernel``), else TF's ``name`` without ``:0``."""
    path = getattr(variable, "path", None)
    if isinstance(path, str) and path:
        return path
    return str(getattr(variable, "name", "tensor")).split(":")[0]


def check_not_xla() -> None:
    """Raises ValueError inside an XLA-compiled function, where numpy_function cannot run."""
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # private module moved: XLA then fails with its own message
        return
    graph = tf.compat.v1.get_default_graph()
    if control_flow_util.GraphOrParentsInXlaContext(graph):
        raise ValueError(
            "bpstrain's push_pull runs in Python and cannot be compiled by XLA; use "
            "tf.function(jit_compile=False), or model.compile(..., jit_compile=False) "
            "with Keras. Received: jit_compile=True")


def run_group(kind: str, tensors: Sequence, names: Sequence[str], average: bool = True,
              root_rank: int = 0, priorities: Optional[Sequence[int]] = None) -> List[tf.Tensor]:
    """push_pulls (``kind="push_pull"``) or broadcasts a list of tensors as one group.

    Returns tensors of the inputs' dtypes and static shapes, without gradients.
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []

    @tf.autograph.experimental.do_not_convert  # plain Python, run by numpy_function
    def run(*arrays):
        if kind == "push_pull":
            return _group.push_pull_group(arrays, names, average, priorities)
        return _group.broadcast_group(arrays, names, root_rank, priorities)

    if tf.executing_eagerly():
        return [tf.convert_to_tensor(out) for out in run(*(t.numpy() for t in tensors))]
    check_not_xla()
    outs = tf.numpy_function(run, tensors, [t.dtype for t in tensors], stateful=True,
                             name=f"bpstrain_{kind}")
    for out, tensor in zip(outs, tensors):
        out.set_shape(tensor.shape)
    return list(outs)


def push_pull(tensor, average: Optional[bool] = None, name: Optional[str] = None,
              priority: int = 0, compression=Compression.none, op=None):
    """Sums or averages ``tensor`` over all ranks (eagerly or inside ``tf.function``).

    Differentiable: the gradient of an average is the average of the upstream
    gradients over all ranks (of a sum, their sum), as in Horovod.

    Args:
        tensor: A tensor of dtype uint8, int8, int32, int64, float16, bfloat16,
            float32 or float64. Integer averages use floor division.
        average: Average (default) or sum; or say it with ``op``.
        name: Engine name; every rank must use the same one. Derived from the graph
            tensor inside ``tf.function``; counted per call when eager and omitted.
            The derived name does not include shape or dtype (so that ranks that
            disagree get an error, not a wait): a function traced again with another
            shape or dtype, or two functions of one Python name, need explicit names.
        priority: Larger is sent sooner.
        compression: A cast (``Compression.fp16``/``bf16`` or their spec strings: the
            tensor travels in that dtype) or a stateful codec object
            (``Compression.topk(0.01)`` etc., made once: it keeps an error-feedback
            residual under ``name``; not differentiable).
        op: ``Average`` or ``Sum`` (Horovod's spelling of ``average``).

    Returns:
        A tensor of the same shape and dtype.

    Raises:
        MismatchError: eagerly, when ranks disagree on shape or dtype (inside
            ``tf.function``: ``tf.errors.UnknownError`` carrying that message).
        ValueError: both ``average`` and ``op``, or an ``op`` other than Average/Sum.
    """
    average = resolve_average(average, op)
    compression = for_push_pull(compression)
    check_compression(compression)
    tensor = tf.convert_to_tensor(tensor)
    name = tensor_name("push_pull", tensor, name)
    if is_stateful(compression):
        return compression.reduce([tensor], [name], average, [priority])[0]
    sent, ctx = compression.compress(tensor)
    return compression.decompress(_push_pull(sent, average, name, priority), ctx)


def _push_pull(tensor, average, name, priority):
    @tf.custom_gradient
    def op(x):
        result = run_group("push_pull", [x], [name], average, priorities=[priority])[0]

        def grad(upstream):
            return _push_pull(tf.convert_to_tensor(upstream), average, name + ".grad", priority)

        return result, grad

    return op(tensor)


def broadcast(tensor, root_rank: int, name: Optional[str] = None):
    """Returns ``root_rank``'s value of ``tensor`` on every rank.

    Differentiable as in Horovod: the root's gradient is the sum of every rank's
    upstream gradient, the other ranks' gradient is zero.

    Args:
        tensor: A tensor of a supported dtype (see :func:`push_pull`).
        root_rank: The rank whose value is sent.
        name: Engine name (derived as in :func:`push_pull` when omitted).
    """
    tensor = tf.convert_to_tensor(tensor)
    return _broadcast(tensor, root_rank, tensor_name("broadcast", tensor, name))


def _broadcast(tensor, root_rank, name):
    @tf.custom_gradient
    def op(x):
        result = run_group("broadcast", [x], [name], root_rank=root_rank)[0]

        def grad(upstream):
            total = _push_pull(tf.convert_to_tensor(upstream), False, name + ".grad", 0)
            return total if engine.rank() == root_rank else tf.zeros_like(total)

        return result, grad

    return op(tensor)




def allgather(tensor, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set=None):
    """Horovod's ``allgather``: every rank's ``tensor`` concatenated along dimension 0.

    Ranks may pass different first dimensions (the other dimensions and the dtype must
    agree). Works eagerly and inside ``tf.function``; differentiable as in Horovod: a
    rank's gradient is its own rows of the sum of every rank's upstream gradient. Each
    rank sends its rows once (one engine broadcast rooted at each rank, after a small
    push_pull of the row counts).

    Args:
        tensor: A tensor of at least one dimension, of a supported dtype (see
            :func:`push_pull`).
        name: Engine name (derived as in :func:`push_pull` when omitted).
        ignore_name_scope: Accepted for Horovod's signature (names are not scoped).
        process_set: Only ``None``: every collective spans all workers.

    Returns:
        A tensor of the input's dtype with ``sum of every rank's rows`` rows.

    Raises:
        ValueError: a 0-d tensor.
        NotImplementedError: a ``process_set``.
        MismatchError: ranks disagree on the trailing dimensions or the dtype.
    """
    del ignore_name_scope
    if process_set is not None:
        raise NotImplementedError(
            "process_set is not offered: every bpstrain collective spans all workers. "
            f"Received: process_set={process_set!r}")
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("allgather needs a tensor of at least one dimension (it concatenates "
                         "along dimension 0). Received: a 0-d tensor")
    return _allgather(tensor, tensor_name("allgather", tensor, name))


def _gather_rows(tensor, name):
    """(every rank's rows concatenated, the rows of each rank as int64), eager or in a graph."""

    @tf.autograph.experimental.do_not_convert  # plain Python, run by numpy_function
    def run(array):
        return _group.allgather(array, name)

    if tf.executing_eagerly():
        out, counts = run(tensor.numpy())
        return tf.convert_to_tensor(out), tf.convert_to_tensor(counts)
    check_not_xla()
    out, counts = tf.numpy_function(run, [tensor], [tensor.dtype, tf.int64], stateful=True,
                                    name="bpstrain_allgather")
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    counts.set_shape([engine.size()])
    return out, counts


def _allgather(tensor, name):
    @tf.custom_gradient
    def op(x):
        out, counts = _gather_rows(x, name)

        def grad(upstream):
            total = _push_pull(tf.convert_to_tensor(upstream), False, name + ".grad", 0)
            start = tf.reduce_sum(counts[:engine.rank()])
            return total[start:start + tf.shape(x, out_type=tf.int64)[0]]

        return out, grad

    return op(tensor)
