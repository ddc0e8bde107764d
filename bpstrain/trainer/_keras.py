"""The Keras branch of ``fit``: ``model.fit`` with :class:`bpstrain.keras.BytePSCallback`.

Thin on purpose: Keras runs the loop; gradients are averaged by
``bpstrain.keras.DistributedOptimizer`` (the model is re-compiled with it when its
optimizer is a plain one), ``BytePSCallback`` broadcasts rank 0's variables at train
begin, and a bridge turns Keras' hook calls into Trainer events, so the same
callbacks (progress bar, CSV, early stopping, LR schedule, metric averaging) work.
Data: an ``(x, y)`` pair of arrays or a callable returning one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from bpstrain.config import ConfigError
from bpstrain.trainer._dispatch import fire
from bpstrain.trainer.history import History


def _arrays(data: Any, what: str):
    if callable(data):
        data = data()
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        raise TypeError(f"With a Keras model, {what} must be an (x, y) pair of arrays or a "
                        f"callable returning one. Received: {type(data).__name__}")
    return np.asarray(data[0]), np.asarray(data[1])


def _train_shard(x, y, rank: int, size: int):
    """Strided shard padded to ceil(n/size), so every rank runs the same number of steps."""
    per_rank = math.ceil(len(x) / size)
    index = np.resize(np.arange(len(x)), per_rank * size)[rank::size]
    return x[index], y[index]


def _compile(model, cfg, size: int) -> None:
    import keras

    from bpstrain.keras import DistributedOptimizer
    from bpstrain.keras._optimizer import _DistributedMixin

    compiled = getattr(model, "compiled", False)
    if compiled and (size == 1 or isinstance(model.optimizer, _DistributedMixin)):
        return  # alone, or the user already wrapped the optimizer
    if compiled:
        args = dict(model._compile_config.config)  # the user's own compile() arguments
        optimizer = args["optimizer"]
        if isinstance(optimizer, str):
            optimizer = keras.optimizers.get(optimizer)
    else:
        o = cfg.optimizer
        lr = float(o.lr) * (size if o.scale_lr else 1)
        optimizer = {
            "sgd": lambda: keras.optimizers.SGD(lr, momentum=o.momentum, nesterov=o.nesterov),
            "adam": lambda: keras.optimizers.Adam(lr, *o.betas, epsilon=o.eps),
            "adamw": lambda: keras.optimizers.AdamW(lr, o.weight_decay or 0.004, *o.betas,
                                                    epsilon=o.eps),
            "rmsprop": lambda: keras.optimizers.RMSprop(lr, momentum=o.momentum, epsilon=o.eps),
            "adagrad": lambda: keras.optimizers.Adagrad(lr, epsilon=o.eps),
        }[o.name]()
        losses = {"cross_entropy": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  "mse": "mse", "l1": "mae", "bce_with_logits":
                  keras.losses.BinaryCrossentropy(from_logits=True)}
        if cfg.trainer.loss not in losses:
            raise ConfigError(f"trainer.loss={cfg.trainer.loss!r} has no Keras counterpart; "
                              "compile the model yourself. Received: "
                              f"trainer.loss={cfg.trainer.loss!r}")
        classify = cfg.trainer.loss in ("cross_entropy", "bce_with_logits")
        args = {"loss": losses[cfg.trainer.loss], "metrics": ["accuracy"] if classify else None}
    if size > 1:
        if getattr(optimizer, "built", False) and int(optimizer.iterations) == 0:
            # Built (compile() built it, or the model came through pickle) but never
            # stepped: nothing is lost by starting from its config, so DistributedOptimizer's
            # "state is not carried over" warning would be noise. A stepped one still warns.
            optimizer = type(optimizer).from_config(optimizer.get_config())
        optimizer = DistributedOptimizer(optimizer)
    model.compile(**{**args, "optimizer": optimizer})


def _bridge(trainer, model, samples: int, size: int):
    """A keras Callback that forwards Keras' hooks to the Trainer's callbacks.

    Args:
        samples: Training samples of this rank per epoch.
        size: Batch size.
    """
    import keras

    callbacks = trainer.callbacks

    class _Bridge(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            trainer.optimizer = model.optimizer
            fire(callbacks, "fit_start", trainer, model, logs=dict(logs or {}))
            fire(callbacks, "train_start", trainer, model)

        def on_epoch_begin(self, epoch, logs=None):
            trainer.current_epoch, trainer.logs = epoch, {}
            fire(callbacks, "train_epoch_start", trainer, model, epoch=epoch, logs=trainer.logs)

        def on_train_batch_begin(self, batch, logs=None):
            fire(callbacks, "train_batch_start", trainer, model, batch=None, batch_idx=batch,
                 logs=logs)

        def on_train_batch_end(self, batch, logs=None):
            last = batch + 1 == trainer.num_training_batches
            trainer.last_batch_size = samples - batch * size if last else size
            trainer.progress_step = trainer.current_epoch * trainer.num_training_batches + batch + 1
            trainer.global_step += 1
            logs = {k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0}
            fire(callbacks, "train_batch_end", trainer, model, outputs=logs, batch=None,
                 batch_idx=batch, logs=logs)

        def on_test_begin(self, logs=None):
            fire(callbacks, "validation_start", trainer, model, logs=trainer.logs)
            fire(callbacks, "validation_epoch_start", trainer, model)

        def on_test_end(self, logs=None):
            fire(callbacks, "validation_epoch_end", trainer, model)
            fire(callbacks, "validation_end", trainer, model, logs=trainer.logs)

        def on_epoch_end(self, epoch, logs=None):
            trainer.logs.update({k: float(v) for k, v in (logs or {}).items()})
            fire(callbacks, "train_epoch_end", trainer, model, epoch=epoch, logs=trainer.logs)
            trainer.history.append({"epoch": epoch, **trainer.logs})
            trainer.epochs_completed += 1
            if logs is not None:
                logs.update(trainer.logs)
            if trainer.should_stop:
                model.stop_training = True

        def on_train_end(self, logs=None):
            fire(callbacks, "train_end", trainer, model, logs=trainer.history.last)
            fire(callbacks, "fit_end", trainer, model)

    return _Bridge()


def fit_keras(trainer, model, data: Any, val_data: Any) -> History:
    """Trains a Keras model on this rank's shard with ``model.fit``; returns the history."""
    from bpstrain.keras import BytePSCallback

    cfg = trainer.config
    t = cfg.trainer
    if str(t.precision) != "32" or t.gradient_clip_val is not None:
        raise ConfigError("trainer.precision and trainer.gradient_clip_val apply to torch "
                          "modules; for a Keras model use keras.mixed_precision.set_global_policy"
                          "('mixed_bfloat16') and the optimizer's clipnorm/clipvalue. Received: "
                          f"trainer.precision={t.precision!r}, "
                          f"trainer.gradient_clip_val={t.gradient_clip_val!r}")
    if cfg.trainer.resume:
        raise ConfigError("trainer.resume is supported for torch modules only; restore Keras "
                          "weights with model.load_weights(). "
                          f"Received: trainer.resume={cfg.trainer.resume!r}")
    x, y = _train_shard(*_arrays(data, "data"), trainer.rank, trainer.size)
    batch = int(cfg.trainer.batch_size)
    if cfg.trainer.steps:
        x, y = x[:cfg.trainer.steps * batch], y[:cfg.trainer.steps * batch]
    validation = None
    if val_data is not None and cfg.trainer.val_every:
        vx, vy = _arrays(val_data, "val_data")
        validation = (vx[trainer.rank::trainer.size], vy[trainer.rank::trainer.size])
    trainer.module = model
    trainer.num_training_batches = math.ceil(len(x) / batch)
    _compile(model, cfg, trainer.size)
    # Our MetricAveraging averages the logs (so torch and Keras behave the same).
    keras_callbacks = [BytePSCallback(average_metrics=False),
                       _bridge(trainer, model, len(x), batch)]
    model.fit(x, y, batch_size=batch, epochs=trainer.max_epochs, validation_data=validation,
              validation_freq=max(int(cfg.trainer.val_every), 1), shuffle=bool(cfg.data.shuffle),
              callbacks=keras_callbacks, verbose=0)
    return trainer.history
