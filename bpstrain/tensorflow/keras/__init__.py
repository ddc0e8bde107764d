"""``import bpstrain.tensorflow.keras as bps``: the module Horovod's and BytePS's TF2-Keras
scripts import (``horovod.tensorflow.keras``, ``byteps.tensorflow.keras``).

A thin layer over :mod:`bpstrain.keras` with the TensorFlow backend: the same
optimizer wrapper and callbacks, under Horovod's names and signatures. For example
the canonical TF2-Keras MNIST script runs after only the rename::

    import tensorflow as tf
    import bpstrain.tensorflow.keras as bps

    bps.init()
    model = tf.keras.Sequential([tf.keras.layers.Conv2D(32, [3, 3], activation="relu"),
                                 ...])                       # built lazily: fine
    opt = bps.DistributedOptimizer(tf.optimizers.Adam(0.001 * bps.size()))
    model.compile(loss=..., optimizer=opt, metrics=["accuracy"])
    model.fit(dataset, steps_per_epoch=500 // bps.size(), epochs=24,
              verbose=1 if bps.rank() == 0 else 0, callbacks=[
                  bps.callbacks.BroadcastGlobalVariablesCallback(0),
                  bps.callbacks.MetricAverageCallback(),
                  bps.callbacks.LearningRateWarmupCallback(warmup_epochs=3, verbose=1)])

Not offered: ``broadcast_global_variables`` (TF1 sessions; it raises and names the
alternative), ``load_model`` and elastic training.
"""

from typing import Optional

import keras

if keras.backend.backend() != "tensorflow":
    raise ImportError("bpstrain.tensorflow.keras needs the TensorFlow Keras backend; use "
                      "bpstrain.keras with other backends. Received: KERAS_BACKEND="
                      f"{keras.backend.backend()!r}")

from bpstrain import _group, engine  # noqa: E402 (the check above comes first)
from bpstrain.engine import (  # noqa: E402
    barrier, init, is_initialized, local_rank, local_size, rank, shutdown, size)
from bpstrain.keras import broadcast_variables  # noqa: E402
from bpstrain.keras import push_pull as _keras_push_pull  # noqa: E402
from bpstrain.tensorflow import Average, Compression, Sum  # noqa: E402
from bpstrain.tensorflow import DistributedOptimizer as _tf_distributed_optimizer  # noqa: E402
from bpstrain.tensorflow._ops import resolve_average  # noqa: E402
from bpstrain.tensorflow.keras import callbacks  # noqa: E402

__all__ = [
    "Average", "Compression", "DistributedOptimizer", "Sum", "allgather", "allreduce", "barrier",
    "broadcast", "broadcast_global_variables", "broadcast_variables", "callbacks", "init",
    "is_initialized", "local_rank", "local_size", "push_pull", "rank", "shutdown", "size",
]


def DistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op=Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False):
    """Horovod's ``horovod.tensorflow.keras.DistributedOptimizer`` signature over
    :func:`bpstrain.keras.DistributedOptimizer`.

    Args:
        optimizer: A Keras 3 optimizer, not built yet.
        name: Prefix of the engine names (see bpstrain.keras).
        device_dense, device_sparse: Accepted and ignored (gradients travel through
            host memory).
        sparse_as_dense: Embedding gradients (``IndexedSlices``) travel as rows
            unless True (see bpstrain.keras).
        compression: ``Compression.none``, ``fp16``, ``bf16`` or a stateful codec
            (``Compression.onebit()``, ``topk(r)``, ... of bpstrain.tensorflow).
        gradient_predivide_factor: Only 1.0 (no split of the averaging).
        op: ``Average`` only: Keras gradients are always averaged.
        backward_passes_per_step: Local aggregation, see bpstrain.keras.
        average_aggregated_gradients: See bpstrain.keras.

    Raises:
        ValueError: an option that does not map (``op=Sum``, a predivide factor,
            compression with ``backward_passes_per_step > 1``) or a non-Keras optimizer.
    """
    if gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor is not offered; scale the loss instead. "
                         f"Received: gradient_predivide_factor={gradient_predivide_factor!r}")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError("DistributedOptimizer wraps a keras.optimizers.Optimizer. "
                         f"Received: {type(optimizer).__name__}")
    return _tf_distributed_optimizer(
        optimizer, name=name, op=op, compression=compression, sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients)


def push_pull(value, name: Optional[str] = None, average: bool = True):
    """Averages (or sums) a tensor, array or number over all ranks; returns numpy (BytePS)."""
    return _keras_push_pull(value, average=average, name=name)


def allreduce(value, name: Optional[str] = None, average: Optional[bool] = None, op=None):
    """Horovod's spelling of :func:`push_pull`: ``op=Average`` (default) or ``op=Sum``."""
    return _keras_push_pull(value, average=resolve_average(average, op), name=name)


def allgather(value, name: Optional[str] = None):
    """Every rank's rows of a tensor, array or number list, concatenated along dimension 0,
    as numpy (Horovod's ``horovod.tensorflow.keras.allgather``; first dimensions may differ)."""
    import numpy as np

    array = np.asarray(keras.ops.convert_to_numpy(value))
    return _group.allgather(array, name or engine.auto_name("keras.allgather"))[0]


def broadcast(value, root_rank: int, name: Optional[str] = None):
    """Returns ``root_rank``'s value of a tensor, array or number as numpy, on every rank."""
    import numpy as np

    return engine.broadcast(np.asarray(keras.ops.convert_to_numpy(value)), root_rank, name=name)


def broadcast_global_variables(root_rank: int):
    """Not offered: TF2 has no global-variables collection (Horovod needs a TF1 session).

    Raises:
        NotImplementedError: always, naming the alternatives.
    """
    raise NotImplementedError(
        "broadcast_global_variables needs TF1 graph collections; use "
        "callbacks.BroadcastGlobalVariablesCallback(root_rank) with fit, or "
        "broadcast_variables(model.variables, root_rank) (and the optimizer's). "
        f"Received: root_rank={root_rank!r}")
