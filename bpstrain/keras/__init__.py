"""Keras 3 adapter: ``import bpstrain.keras as bps`` (TensorFlow and torch backends).

The three-line change to a Keras script (run it with
``python -m bpstrain.launch --workers N -- python train.py``)::

    import bpstrain.keras as bps
    bps.init()
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.01 * bps.size())),
                  loss=...)
    model.fit(..., callbacks=[bps.BytePSCallback()], verbose=1 if bps.rank() == 0 else 0)

``KERAS_BACKEND`` must be set before keras is first imported. With the TensorFlow
backend ``model.fit`` runs the gradient push_pull inside its ``tf.function`` (XLA off;
see :mod:`bpstrain.keras._optimizer`); with the torch backend it runs eagerly. JAX is
not supported. Batch normalization statistics stay per rank (as in Horovod); only
weights that receive gradients are kept identical.

Contents: :func:`DistributedOptimizer`, the callbacks of :mod:`bpstrain.keras.callbacks`
(:class:`BytePSCallback`, :class:`BroadcastGlobalVariablesCallback`,
:class:`MetricAverageCallback`, :class:`LearningRateWarmupCallback`,
:class:`LearningRateScheduleCallback`), :func:`push_pull`, :func:`broadcast_variables`
and the engine's ``init``/``shutdown``/``rank``/``size``/``local_rank``/``local_size``.
"""

from bpstrain.engine import (barrier, init, is_initialized, local_rank, local_size, rank,
                             shutdown, size)

_LAZY = {
    "DistributedOptimizer": "bpstrain.keras._optimizer",
    "BytePSCallback": "bpstrain.keras.callbacks",
    "BroadcastGlobalVariablesCallback": "bpstrain.keras.callbacks",
    "MetricAverageCallback": "bpstrain.keras.callbacks",
    "LearningRateWarmupCallback": "bpstrain.keras.callbacks",
    "LearningRateScheduleCallback": "bpstrain.keras.callbacks",
}

__all__ = sorted([*_LAZY, "barrier", "broadcast_variables", "callbacks", "elastic", "init",
                  "is_initialized", "local_rank", "local_size", "push_pull", "rank",
                  "shutdown", "size"])


def __getattr__(name):
    # Lazy, so that importing bpstrain.keras imports neither keras nor (with
    # KERAS_BACKEND=torch) torch until one of these is used.
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in ("callbacks", "elastic"):
        return importlib.import_module(f"bpstrain.keras.{name}")
    raise AttributeError(f"module 'bpstrain.keras' has no attribute {name!r}")


def push_pull(value, average: bool = True, name=None):
    """Averages (or sums) a tensor, array or number over all ranks, eagerly.

    Args:
        value: A backend tensor, numpy array or Python number.
        average: Average (default) or sum.
        name: Engine name; default: numbered per call (same call order on every rank).

    Returns:
        A numpy array (callers convert back with ``keras.ops.convert_to_tensor``).
    """
    import keras
    import numpy as np

    from bpstrain import engine

    return engine.push_pull(np.asarray(keras.ops.convert_to_numpy(value)), name=name,
                            average=average)


def broadcast_variables(variables, root_rank: int = 0, name=None) -> None:
    """Assigns ``root_rank``'s values to Keras variables (e.g. ``model.variables``), eagerly.

    Engine names are ``<name>.<index>``; by default calls are numbered in order (every
    rank must broadcast the same lists in the same order).
    """
    from bpstrain.keras.callbacks import broadcast_variables as run

    run(variables, root_rank, name)
