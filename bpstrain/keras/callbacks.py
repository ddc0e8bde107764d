"""Keras 3 callbacks for data-parallel training (Horovod's set, plus BytePSCallback).

Put them first in ``callbacks=[...]`` so that later callbacks (checkpoints, early
stopping) see averaged metrics and broadcast weights. Every rank must use the same
callbacks in the same order: each one calls into the engine collectively.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Callable, Optional, Union

import keras

from bpstrain import _group, engine


def _variables_to_numpy(variables):
    return [keras.ops.convert_to_numpy(v) for v in variables]


_broadcast_calls = itertools.count()


def broadcast_variables(variables, root_rank: int, prefix: Optional[str] = None) -> None:
    """Assigns ``root_rank``'s value to each Keras variable (any backend), eagerly.

    Engine names are ``<prefix>.<index>``; the default prefix numbers the calls in
    this process (``keras.broadcast.<k>``), so every rank must broadcast the same
    lists in the same order (they must anyway: a broadcast is collective).
    """
    prefix = prefix or f"keras.broadcast.{next(_broadcast_calls)}"
    variables = list(variables)
    names = [f"{prefix}.{i}" for i in range(len(variables))]
    values = _group.broadcast_group(_variables_to_numpy(variables), names, root_rank)
    for variable, value in zip(variables, values):
        variable.assign(value)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcasts model and optimizer variables from ``root_rank`` once, on the first ``fit``.

    A built model (an ``Input`` or input shape given) is broadcast in
    ``on_train_begin``, so every rank starts from the same weights, optimizer slots,
    iterations and learning rate. A lazily built model (a ``Sequential`` without an
    input shape, a subclassed model never called) has no variables before its first
    step; it is broadcast right after that step, before the second batch (or at the
    end of the epoch, when it has one batch), as Horovod does. Only then is the
    optimizer built: building it earlier, over no variables, would make the first
    step fail with "Unknown variable".

    Args:
        root_rank: The rank whose variables everyone gets.
        device: Accepted for BytePS/Horovod compatibility and ignored: bpstrain moves
            the values through host memory whatever the device.
    """

    def __init__(self, root_rank: int = 0, device: Optional[str] = ""):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        self._broadcast_once()

    # on_train_batch_begin, unlike on_train_batch_end, keeps Keras' asynchronous batch
    # dispatch on; batch 1 begins right after the first step has built the model.
    def on_train_batch_begin(self, batch, logs=None):
        self._broadcast_once()

    def on_epoch_end(self, epoch, logs=None):
        self._broadcast_once()

    def _broadcast_once(self) -> None:
        if self.broadcast_done or not _model_is_built(self.model):
            return
        broadcast_variables(self.model.variables, self.root_rank)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            broadcast_variables(optimizer.variables, self.root_rank)
        self.broadcast_done = True


def _model_is_built(model) -> bool:
    """Whether the model and every layer in it has created its variables."""
    if not getattr(model, "built", True):
        return False
    layers = getattr(model, "_flatten_layers", None)
    return layers is None or all(getattr(layer, "built", True) for layer in layers())


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch-end metric in ``logs`` by its average over all ranks.

    ``history.history`` then holds the same values on every rank. Batch-level
    progress bars still show local values (averaging them would cost a round
    trip per batch).

    Args:
        device: Accepted for BytePS/Horovod compatibility and ignored (metrics are
            averaged through host memory).
    """

    def __init__(self, device: Optional[str] = ""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        values = [_as_float64(logs[k]) for k in keys]
        averaged = _group.push_pull_group(values, [f"keras.metric.{k}" for k in keys], True)
        for key, value in zip(keys, averaged):
            logs[key] = float(value)


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _as_float64(value):
    import numpy as np

    return np.asarray(float(value), dtype=np.float64)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets ``optimizer.learning_rate = initial_lr * multiplier(epoch)`` (Horovod's meaning).

    Args:
        initial_lr: The base learning rate (usually already scaled by ``size()``);
            None (BytePS's signature, which has no such argument) takes the
            optimizer's rate when the first ``fit`` begins.
        multiplier: A number, or a function of the epoch; with ``staircase=False``
            the epoch is fractional (``epoch + batch / steps_per_epoch``).
        start_epoch: First epoch (inclusive) the schedule acts on.
        end_epoch: Epoch (exclusive) it stops acting on; None for no end.
        staircase: Adjust once per epoch (True) or before every batch (False).
        momentum_correction: Horovod scales momentum by new_lr / old_lr for the batch
            the rate changes. Keras 3 optimizers keep momentum as a Python float
            compiled into the train step, so this is not applied: True only warns.
        steps_per_epoch: Batches per epoch; default: what ``fit`` reports.
        verbose: Print the rate when it changes (rank 0 only).
    """

    def __init__(self, initial_lr: Optional[float] = None,
                 multiplier: Union[float, Callable] = 1.0,
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = False, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0):
        super().__init__()
        self.initial_lr = None if initial_lr is None else float(initial_lr)
        if callable(multiplier):
            self.multiplier = multiplier
            self.staircase = staircase
        else:  # A constant needs no per-batch updates.
            self.multiplier = lambda epoch, value=float(multiplier): value
            self.staircase = True
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0

    def on_train_begin(self, logs=None):
        if self.initial_lr is None:
            self.initial_lr = get_learning_rate(self.model.optimizer)
        if self.momentum_correction:
            warnings.warn("momentum_correction is not applied with Keras 3 optimizers (their "
                          "momentum is a constant of the compiled train step). Received: "
                          "momentum_correction=True", stacklevel=2)
        if not self.staircase and not self._steps():
            raise ValueError("staircase=False needs the number of batches per epoch; pass "
                             "steps_per_epoch=. Received: steps_per_epoch=None and fit() "
                             "did not report steps")

    def _steps(self) -> Optional[int]:
        return self.steps_per_epoch or (self.params or {}).get("steps")

    def _active(self, epoch) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._active(epoch):
            self._set(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self.staircase and self._active(self.current_epoch):
            self._set(self.current_epoch + float(batch) / self._steps())

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = get_learning_rate(self.model.optimizer)

    def _set(self, epoch: float) -> None:
        new_lr = self.initial_lr * self.multiplier(epoch)
        set_learning_rate(self.model.optimizer, new_lr)
        if self.verbose and engine.rank() == 0:
            print(f"\nEpoch {epoch:.3f}: learning rate set to {new_lr:g}.")


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from ``initial_lr / size()`` to ``initial_lr`` (Goyal et al.).

    Both Horovod's ``LearningRateWarmupCallback(initial_lr=..., warmup_epochs=...)``
    and BytePS's ``LearningRateWarmupCallback(warmup_epochs=..., momentum_correction=...,
    steps_per_epoch=..., verbose=...)`` (the target is the optimizer's rate) work; a
    positional first argument is Horovod's ``initial_lr``.

    Horovod's formula, per batch: ``lr = initial_lr / size * (e * (size - 1) /
    warmup_epochs + 1)`` with ``e = epoch + (batch + 1) / steps_per_epoch``, so the
    last batch of epoch ``warmup_epochs - 1`` runs at ``initial_lr``. Afterwards the
    rate is left alone (a later schedule may take over).

    Args:
        initial_lr: The target rate, usually ``base_lr * size()``; None: the
            optimizer's learning rate when the first ``fit`` begins.
        warmup_epochs: Number of epochs of the ramp.
        momentum_correction: See :class:`LearningRateScheduleCallback`.
        steps_per_epoch: Batches per epoch; default: what ``fit`` reports.
        verbose: Print when the warm-up ends (rank 0 only).
    """

    def __init__(self, initial_lr: Optional[float] = None, warmup_epochs: int = 5,
                 momentum_correction: bool = False, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0):
        self.warmup_epochs = warmup_epochs
        super().__init__(initial_lr, multiplier=self._multiplier, start_epoch=0,
                         end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=0)
        self.warmup_verbose = verbose

    def _multiplier(self, epoch: float) -> float:
        size = engine.size()
        epoch += 1.0 / self._steps()  # lands on round numbers at each epoch's end
        return 1.0 / size * (epoch * (size - 1) / self.warmup_epochs + 1)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.warmup_verbose and engine.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{get_learning_rate(self.model.optimizer):g}.")


def get_learning_rate(optimizer) -> float:
    """The optimizer's current learning rate as a Python float."""
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def set_learning_rate(optimizer, value: float) -> None:
    """Assigns the learning rate; it must be a variable, not a LearningRateSchedule."""
    if isinstance(getattr(optimizer, "_learning_rate", None),
                  keras.optimizers.schedules.LearningRateSchedule):
        raise ValueError("the optimizer's learning_rate is a LearningRateSchedule, which a "
                         "callback cannot set; pass a float learning rate to the optimizer. "
                         f"Received: learning_rate={optimizer._learning_rate!r}")
    optimizer.learning_rate = value


class BytePSCallback(keras.callbacks.Callback):
    """The usual set in one callback: broadcast, metric averaging, optional warm-up.

    * ``on_train_begin``: broadcasts model and optimizer variables from ``root_rank``,
      once per callback object (a lazily built model: after its first step, see
      :class:`BroadcastGlobalVariablesCallback`);
    * ``on_epoch_end``: averages the epoch's metrics over all ranks (``history``
      is then identical everywhere);
    * with ``warmup_epochs > 0``: :class:`LearningRateWarmupCallback` to
      ``initial_lr`` (default: the optimizer's learning rate at train begin).

    With the TensorFlow backend it also turns XLA off (``model.jit_compile = False``,
    with a warning) because the gradient push_pull runs in Python.

    Example::

        model.fit(x, y, callbacks=[bps.BytePSCallback(warmup_epochs=3)],
                  verbose=1 if bps.rank() == 0 else 0)

    Args:
        root_rank: The rank whose variables everyone starts from.
        average_metrics: Average epoch-end metrics over ranks.
        warmup_epochs: Epochs of learning-rate warm-up; 0 for none.
        initial_lr: Warm-up target; default: the optimizer's rate at train begin.
        steps_per_epoch: Batches per epoch, when ``fit`` cannot tell.
        verbose: Print when the warm-up ends (rank 0 only).
    """

    def __init__(self, root_rank: int = 0, average_metrics: bool = True,
                 warmup_epochs: int = 0, initial_lr: Optional[float] = None,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        super().__init__()
        self.broadcast = BroadcastGlobalVariablesCallback(root_rank)
        self.metrics = MetricAverageCallback() if average_metrics else None
        self.warmup_epochs, self.initial_lr = warmup_epochs, initial_lr
        self.steps_per_epoch, self.verbose = steps_per_epoch, verbose
        self.warmup: Optional[LearningRateWarmupCallback] = None

    def _parts(self):
        return [c for c in (self.broadcast, self.warmup, self.metrics) if c is not None]

    def set_model(self, model):
        super().set_model(model)
        if keras.backend.backend() == "tensorflow" and getattr(model, "jit_compile", False):
            warnings.warn("BytePSCallback turns XLA off (jit_compile=False): the gradient "
                          "push_pull runs in Python. Received: jit_compile=True", stacklevel=2)
            model.jit_compile = False
            model.train_function = None  # rebuilt without XLA
        for part in self._parts():
            part.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        for part in self._parts():
            part.set_params(params)

    def on_train_begin(self, logs=None):
        self.broadcast.on_train_begin(logs)
        if self.warmup_epochs and self.warmup is None:
            self.warmup = LearningRateWarmupCallback(self.initial_lr, self.warmup_epochs,
                                                     steps_per_epoch=self.steps_per_epoch,
                                                     verbose=self.verbose)
            self.warmup.set_model(self.model)
            self.warmup.set_params(self.params)
        if self.warmup is not None:
            self.warmup.on_train_begin(logs)

    def on_epoch_begin(self, epoch, logs=None):
        if self.warmup is not None:
            self.warmup.on_epoch_begin(epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self.broadcast.on_train_batch_begin(batch, logs)  # a lazily built model
        if self.warmup is not None:
            self.warmup.on_train_batch_begin(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self.broadcast.on_epoch_end(epoch, logs)  # a lazily built model, one batch
        if self.warmup is not None:
            self.warmup.on_epoch_end(epoch, logs)
        if self.metrics is not None:
            self.metrics.on_epoch_end(epoch, logs)
