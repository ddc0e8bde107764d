"""Gradient averaging for TensorFlow: broadcast_variables, DistributedGradientTape,
DistributedOptimizer."""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from bpstrain import _group
from bpstrain._compression import check_optimizer_momentum
from bpstrain.tensorflow import _ops
from bpstrain.tensorflow.compression import (Compression, check_compression, for_optimizer,
                                             reduce_with)


def broadcast_variables(variables: Iterable, root_rank: int, name: str = "broadcast"):
    """Assigns ``root_rank``'s value to every variable on every rank.

    Args:
        variables: tf.Variables or Keras variables (e.g. ``model.variables``).
        root_rank: The rank whose values everyone gets.
        name: Prefix of the engine names (``<name>.<variable path>``); variables of
            different shapes must not share a name across calls.

    Returns:
        None eagerly and inside ``tf.function`` (automatic control dependencies run
        the assignments); in a TF1-style graph the ``tf.group`` op to run.
    """
    variables = list(variables)
    names = _group.unique_names([f"tf.{name}.{_ops.variable_name(v)}" for v in variables])
    values = _ops.run_group("broadcast", variables, names, root_rank=root_rank)
    assigns = [v.assign(value) for v, value in zip(variables, values)]
    if tf.executing_eagerly() or tf.inside_function():
        return None
    return tf.group(*assigns)


def reduce_gradients(grads: Sequence, sources: Sequence, prefix: str,
                     average: bool = True, compression=Compression.none,
                     sparse_as_dense: bool = False) -> List:
    """push_pulls the non-None gradients as one group; None stays None.

    Engine names are ``<prefix>.<source variable path>`` (index for unnamed
    sources). IndexedSlices (embedding gradients) travel as rows (only the rows some
    rank touched, :func:`reduce_indexed_slices`) unless ``sparse_as_dense`` or a
    ``compression`` is given; then they are sent dense, compressed by ``compression``
    on the way (a stateful codec keys its state by those names).
    """
    present = [i for i, g in enumerate(grads) if g is not None]
    names = _group.unique_names([
        f"{prefix}.{_source_name(sources[i], i) if i < len(sources) else i}" for i in present])
    as_rows = not sparse_as_dense and compression is Compression.none
    rows = [(i, name) for i, name in zip(present, names) if as_rows and isinstance(grads[i], tf.IndexedSlices)]
    dense = [(i, name) for i, name in zip(present, names) if (i, name) not in rows]
    reduced = reduce_with(compression, [grads[i] for i, _ in dense], [name for _, name in dense], average)
    out = list(grads)
    for (i, _), value in zip(dense, reduced):
        out[i] = value
    for i, name in rows:
        out[i] = reduce_indexed_slices(grads[i], name, average)
    return out


def reduce_indexed_slices(grad: tf.IndexedSlices, name: str, average: bool = True) -> tf.IndexedSlices:
    """Row-sparse push_pull of an embedding gradient (:mod:`bpstrain._sparse`): only the
    rows some rank touched travel; the result holds their union, eagerly or in a graph."""
    from bpstrain import _sparse

    def run(indices, values, num_rows):
        ids, rows = _sparse.sparse_push_pull(indices, values.reshape(len(indices), -1).astype(np.float32),
                                             name, int(num_rows), average)
        return ids.astype(np.int64), rows.reshape((-1,) + values.shape[1:])

    if tf.executing_eagerly():
        ids, rows = run(grad.indices.numpy(), grad.values.numpy(), int(grad.dense_shape[0]))
    else:
        ids, rows = tf.numpy_function(run, [grad.indices, grad.values, grad.dense_shape[0]],
                                      [tf.int64, tf.float32], stateful=True, name="bpstrain_sparse_rows")
        ids.set_shape([None])
        rows.set_shape([None] + grad.values.shape.as_list()[1:])
    return tf.IndexedSlices(tf.cast(rows, grad.values.dtype), tf.cast(ids, grad.indices.dtype), grad.dense_shape)


def _source_name(source, index: int) -> str:
    if isinstance(source, tf.Tensor) and tf.executing_eagerly():
        return str(index)  # eager tensors have no name
    return _ops.variable_name(source)


class _DistributedTapeMixin:
    """Overrides ``gradient`` of a tf.GradientTape subclass; see DistributedGradientTape."""

    _bps_prefix = "DistributedGradientTape"
    _bps_average = True
    _bps_compression = Compression.none
    _bps_sparse_as_dense = False

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """Like tf.GradientTape.gradient, averaged (or summed) over all ranks."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        flat_sources = tf.nest.flatten(sources, expand_composites=False)
        reduced = reduce_gradients(flat_grads, flat_sources, self._bps_prefix, self._bps_average,
                                   self._bps_compression, self._bps_sparse_as_dense)
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)


def DistributedGradientTape(gradtape: tf.GradientTape, average: Optional[bool] = None,
                            name: Optional[str] = None, compression=Compression.none,
                            op=None, device_dense: str = "", device_sparse: str = "",
                            sparse_as_dense: bool = False) -> tf.GradientTape:
    """Wraps a recorded tape so that ``gradient()`` averages over all ranks.

    Example::

        with tf.GradientTape() as tape:
            loss = loss_fn(model(x), y)
        tape = bps.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    Args:
        gradtape: The tape (its recording is shared, not copied).
        average: Average (default) or sum the gradients; or say it with ``op``.
        name: Prefix of the engine names; give two tapes over different variables
            with the same paths distinct names.
        compression: ``Compression.fp16``/``bf16`` send floating gradients in that
            dtype (they come back in their own); a stateful codec
            (``Compression.onebit()``, ``topk(r)``, ..., or its spec string) compresses
            gradients of at least 1024 elements with error feedback keyed by the engine
            names; ``Compression.policy(...)`` chooses per tensor.
        op: ``Average`` (default) or ``Sum``, as in Horovod.
        device_dense, device_sparse: Accepted for Horovod/BytePS compatibility and
            ignored: gradients travel through host memory.
        sparse_as_dense: Send IndexedSlices (embedding gradients) dense; by default
            only the rows some rank touched travel and the result is IndexedSlices of
            their union (dense with a ``compression``).

    Returns:
        An instance of a subclass of ``type(gradtape)``.

    Raises:
        ValueError: not a tape, both ``average`` and ``op``, an ``op`` other than
            Average/Sum, or a ``compression`` without compress/decompress.
    """
    average = _ops.resolve_average(average, op)
    compression = for_optimizer(compression)  # specs, policies; min_size 1024
    check_compression(compression)
    if not isinstance(gradtape, tf.GradientTape):
        raise ValueError("DistributedGradientTape wraps a tf.GradientTape. "
                         f"Received: {type(gradtape).__name__}")
    base = type(gradtape)
    cls = type(base.__name__, (_DistributedTapeMixin, base), {"__module__": base.__module__})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._bps_prefix = name or "DistributedGradientTape"
    tape._bps_average = average
    tape._bps_compression = compression
    tape._bps_sparse_as_dense = bool(sparse_as_dense)
    return tape


class _DistributedV1Optimizer(tf.compat.v1.train.Optimizer):
    """A tf.compat.v1.train.Optimizer whose compute_gradients averages over ranks."""

    def __init__(self, optimizer, name: Optional[str], average: bool, compression, sparse_as_dense: bool):
        self._optimizer = optimizer
        self._bps_prefix = name or f"Distributed{type(optimizer).__name__}"
        self._bps_average = average
        self._bps_compression = compression
        self._bps_sparse_as_dense = sparse_as_dense
        super().__init__(name=self._bps_prefix, use_locking=False)

    def compute_gradients(self, *args, **kwargs):
        """Gradients of the wrapped optimizer, averaged over all ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads = reduce_gradients([g for g, _ in pairs], [v for _, v in pairs],
                                 self._bps_prefix, self._bps_average, self._bps_compression,
                                 self._bps_sparse_as_dense)
        return list(zip(grads, [v for _, v in pairs]))

    def apply_gradients(self, *args, **kwargs):
        """Delegates to the wrapped optimizer."""
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        """Delegates to the wrapped optimizer."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        """Delegates to the wrapped optimizer."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        """Delegates to the wrapped optimizer."""
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name: Optional[str] = None, average: Optional[bool] = None,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False,
                         compression=Compression.none, op=None, device_dense: str = "",
                         device_sparse: str = "", sparse_as_dense: bool = False):
    """Wraps an optimizer so that gradients are averaged over all ranks before use.

    Args:
        optimizer: A Keras 3 optimizer (``tf.keras.optimizers.*``; handled by
            :func:`bpstrain.keras.DistributedOptimizer`) or a
            ``tf.compat.v1.train.Optimizer``.
        name: Prefix of the engine names.
        average: Average (default) or sum; v1 optimizers only (Keras always averages).
        backward_passes_per_step: Keras optimizers only; see bpstrain.keras.
        average_aggregated_gradients: Keras optimizers only; see bpstrain.keras.
        compression: A cast (``Compression.fp16``/``bf16``) or a stateful codec
            (``Compression.topk(0.01)`` etc.; see :mod:`bpstrain.tensorflow.compression`).
        op: ``Average`` (default) or ``Sum`` (v1 optimizers only), as in Horovod.
        device_dense, device_sparse: Accepted for Horovod/BytePS compatibility and
            ignored (gradients travel through host memory).
        sparse_as_dense: ``IndexedSlices`` gradients (embedding lookups) travel as rows
            (only the rows some rank touched) unless this is True or a compression is
            given; then they are sent dense.

    Raises:
        ValueError: ``optimizer`` is neither kind, or options do not apply to it.
    """
    import keras

    average = _ops.resolve_average(average, op)
    compression = for_optimizer(compression)  # specs, policies; min_size 1024
    check_compression(compression)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        if not average:
            raise ValueError("Keras optimizers always average gradients. Received: "
                             "average=False or op=Sum")
        from bpstrain.keras import DistributedOptimizer as keras_distributed

        return keras_distributed(optimizer, name=name,
                                 backward_passes_per_step=backward_passes_per_step,
                                 average_aggregated_gradients=average_aggregated_gradients,
                                 compression=None if compression is Compression.none
                                 else compression, sparse_as_dense=sparse_as_dense)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1 or average_aggregated_gradients:
            raise ValueError("backward_passes_per_step applies to Keras optimizers only. "
                             f"Received: backward_passes_per_step={backward_passes_per_step} "
                             f"with {type(optimizer).__name__}")
        check_optimizer_momentum(compression, getattr(optimizer, "_momentum", None),
                                 bool(getattr(optimizer, "_use_nesterov", False)))
        return _DistributedV1Optimizer(optimizer, name, average, compression, sparse_as_dense)
    raise ValueError("DistributedOptimizer wraps a keras.optimizers.Optimizer or a "
                     f"tf.compat.v1.train.Optimizer. Received: {type(optimizer).__name__}")
