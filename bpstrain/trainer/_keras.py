"""The Keras branch of ``fit``, ``validate``, ``test`` and ``predict``.

Thin on purpose: Keras runs the loop (``model.fit`` with
:class:`bpstrain.keras.BytePSCallback`); gradients are averaged by
``bpstrain.keras.DistributedOptimizer`` (the model is re-compiled with it when its
optimizer is a plain one), ``BytePSCallback`` broadcasts rank 0's variables at train
begin, and a bridge turns Keras' hook calls into Trainer events, so the same
callbacks (progress bar, CSV, early stopping, LR schedule, metric averaging) work.
Data: an ``(x, y)`` pair of arrays or a callable returning one.

The torch-side keys map onto Keras' own means:

* ``trainer.precision``: ``bf16`` / ``16`` set the ``mixed_bfloat16`` /
  ``mixed_float16`` dtype policy on every layer for the duration of the call
  (variables stay float32, as with torch autocast); with ``16`` the optimizer is a
  ``LossScaleOptimizer`` inside the ``DistributedOptimizer``, so the inf check sees
  the averaged gradients and every rank skips the same steps.
* ``trainer.gradient_clip_val``: the optimizer's ``global_clipnorm`` (algorithm
  ``norm``, the torch meaning) or ``clipvalue`` (``value``), applied by Keras to the
  averaged, unscaled gradients.
* ``validate`` / ``test``: ``model.evaluate`` on this rank's strided shard; each
  metric is weighted by the shard's size and averaged over ranks (exact for means
  such as loss and accuracy). ``predict``: ``model.predict`` of this rank's shard.
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Any, Dict, Optional

import numpy as np

from bpstrain.config import ConfigError
from bpstrain.trainer import _compression_state, _preempt, _resume
from bpstrain.trainer._dispatch import fire
from bpstrain.trainer.callbacks.metrics import average_sums
from bpstrain.trainer.history import History

_POLICIES = {"bf16": "mixed_bfloat16", "16": "mixed_float16"}


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


def _layers(model) -> list:
    """The model and every layer in it, Input layers excepted."""
    import keras

    flatten = getattr(model, "_flatten_layers", None)
    layers = list(flatten(include_self=True, recursive=True)) if flatten else [model]
    return [layer for layer in layers if not isinstance(layer, keras.layers.InputLayer)]


def _reset_functions(model) -> None:
    """Forgets the traced train/test/predict steps (they baked in the old dtypes)."""
    for name in ("train_function", "test_function", "predict_function"):
        if hasattr(model, name):
            setattr(model, name, None)


@contextlib.contextmanager
def precision_policy(model, precision: str):
    """``trainer.precision`` for a Keras model: while inside, every layer computes in
    bfloat16 ("bf16") or float16 ("16") with float32 variables; afterwards each layer
    has its own policy again."""
    if precision == "32":
        yield
        return
    import keras

    layers = _layers(model)
    saved = [layer.dtype_policy for layer in layers]
    policy = keras.dtype_policies.get(_POLICIES[precision])
    for layer in layers:
        layer.dtype_policy = policy
    _reset_functions(model)
    try:
        yield
    finally:
        for layer, old in zip(layers, saved):
            layer.dtype_policy = old
        _reset_functions(model)


def _is_distributed(optimizer) -> bool:
    from bpstrain.keras._optimizer import _DistributedMixin

    inner = getattr(optimizer, "inner_optimizer", None)
    return isinstance(optimizer, _DistributedMixin) or isinstance(inner, _DistributedMixin)


def _unstepped(optimizer):
    """A built optimizer that never stepped, rebuilt from its config (nothing is lost).

    Compile builds it, and a model that came through pickle brings it built; wrapping
    a built one would make DistributedOptimizer warn that its state is not carried
    over. A stepped one is kept (and still warns).
    """
    if getattr(optimizer, "built", False) and int(optimizer.iterations) == 0:
        return type(optimizer).from_config(optimizer.get_config())
    return optimizer


def _set_clipping(optimizer, value: float, algorithm: str) -> None:
    """``trainer.gradient_clip_val`` as the optimizer's global_clipnorm or clipvalue."""
    target = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    own = {k: getattr(target, k, None) for k in ("clipnorm", "clipvalue", "global_clipnorm")}
    own = {k: v for k, v in own.items() if v}
    key = "clipvalue" if algorithm == "value" else "global_clipnorm"
    if own and own != {key: float(value)}:  # equal: set by an earlier fit of this Trainer
        raise ConfigError("trainer.gradient_clip_val is set and the Keras optimizer clips "
                          f"already ({', '.join(f'{k}={v}' for k, v in own.items())}); keep "
                          f"one. Received: trainer.gradient_clip_val={value}")
    # global_clipnorm is torch's clip_grad_norm_ (one norm over all gradients); Keras'
    # clipnorm would clip each variable's gradient on its own.
    setattr(target, key, float(value))


def _compile(model, cfg, size: int, training: bool = True, compression=None) -> None:
    """(Re-)compiles ``model`` for this job: its optimizer gets the config's clipping,
    loss scaling under a mixed_float16 policy, and DistributedOptimizer on several ranks.

    Args:
        training: False for validate/test/predict: only an uncompiled model is compiled
            (from the config), nothing is wrapped.
        compression: The ``comm.compression*`` policy (``Comm.compression_policy``) the
            DistributedOptimizer applies; None: none.
    """
    import keras

    from bpstrain.keras import DistributedOptimizer

    t = cfg.trainer
    clip = t.gradient_clip_val if training else None
    fp16 = training and model.dtype_policy.name == "mixed_float16"
    compiled = getattr(model, "compiled", False)
    if compiled and not training:
        return
    if compiled and _is_distributed(model.optimizer):  # the user wrapped it already
        if clip is not None or (fp16 and not isinstance(
                model.optimizer, keras.optimizers.LossScaleOptimizer)):
            raise ConfigError("The Keras model's optimizer is wrapped in DistributedOptimizer "
                              "already, so trainer.gradient_clip_val and trainer.precision=16 "
                              "cannot go inside the gradient averaging; compile with the plain "
                              "optimizer (the Trainer wraps it). Received: "
                              f"trainer.gradient_clip_val={clip!r}, "
                              f"trainer.precision={t.precision!r}")
        return
    if compiled and size == 1 and clip is None and not fp16:
        return  # alone, nothing to add
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
        if t.loss not in losses:
            raise ConfigError(f"trainer.loss={t.loss!r} has no Keras counterpart; "
                              "compile the model yourself. Received: "
                              f"trainer.loss={t.loss!r}")
        classify = t.loss in ("cross_entropy", "bce_with_logits")
        args = {"loss": losses[t.loss], "metrics": ["accuracy"] if classify else None}
    if training:
        optimizer = _unstepped(optimizer)
        if clip is not None:
            _set_clipping(optimizer, clip, t.gradient_clip_algorithm)
        if fp16 and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            # Inside the averaging: the inf check sees the averaged gradients, so every
            # rank skips the same steps (Keras' own wrapping would go outside).
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        if size > 1:
            optimizer = DistributedOptimizer(optimizer, compression=_compressor(compression))
            if compression is not None and _decides_eagerly(compression):
                args["run_eagerly"] = True  # auto decides per step in Python
    model.compile(**{**args, "optimizer": optimizer})


def _compressor(policy):
    """The TensorFlow compressor of a compression policy (None stays None)."""
    if policy is None:
        return None
    import keras

    if keras.backend.backend() != "tensorflow":
        raise ConfigError("comm.compression with a Keras model needs the TensorFlow backend "
                          "(the codecs are TensorFlow ops); set KERAS_BACKEND=tensorflow or "
                          "train a torch module. Received: KERAS_BACKEND="
                          f"{keras.backend.backend()!r}, comm.compression='{policy.default}'")
    from bpstrain.tensorflow.compression import PolicyCompressor

    return PolicyCompressor(policy)


def _decides_eagerly(policy) -> bool:
    return any(spec.codec == "auto" for spec in
               [policy.default, *(rule.compression for rule in policy.rules)])


class _BridgeHooks:
    """Turns Keras' hook calls of one ``fit`` (one ``model.fit`` call per epoch) into
    Trainer events, and watches for the pre-timeout signal after every step.

    Args:
        samples: Training samples of this rank per epoch.
        size: Batch size.
        val_samples: Validation samples of this rank.
        watch: The :class:`bpstrain.trainer._preempt.Watch` of this fit.
    """

    def __init__(self, trainer, model, samples: int, size: int, val_samples: int, watch):
        super().__init__()  # keras.callbacks.Callback's, in the class _bridge makes
        self.trainer, self.keras_model, self.watch = trainer, model, watch
        self.samples, self.size, self.val_samples = samples, size, val_samples
        self.started = False
        self.offset = 0  # batches of this epoch trained before this model.fit call
        self.prior: Dict[str, list] = {}  # their metric sums: {key: [sum, samples]}
        self.batch_logs: Dict[str, float] = {}
        self.stop_at = None  # the next batch, once the signal stopped this epoch

    def begin_epoch(self, offset: int, prior: Dict[str, list]) -> None:
        self.offset, self.prior, self.batch_logs = offset, prior, {}

    def _seen(self, batches: int) -> int:
        """Samples of this rank trained in this epoch's first ``batches`` batches."""
        return min(batches * self.size, self.samples)

    def sums(self, logs: Dict[str, float], batches: int) -> Dict[str, list]:
        """The epoch's metric sums after ``batches`` batches: those before this
        ``model.fit`` call plus ``logs`` (Keras' running means of this call)."""
        trained = self._seen(batches) - self._seen(self.offset)
        out = {k: list(v) for k, v in self.prior.items()}
        for key, mean in logs.items():
            entry = out.setdefault(key, [0.0, 0.0])
            entry[0] += mean * trained
            entry[1] += trained
        return out

    def on_train_begin(self, logs=None):
        if not self.started:
            self.started = True
            self.trainer.optimizer = self.keras_model.optimizer
            fire(self.trainer.callbacks, "fit_start", self.trainer, self.keras_model,
                 logs=dict(logs or {}))
            fire(self.trainer.callbacks, "train_start", self.trainer, self.keras_model)

    def on_epoch_begin(self, epoch, logs=None):
        t = self.trainer
        t.current_epoch = epoch
        t.logs = dict(t.resume_logs) if self.offset else {}
        fire(t.callbacks, "train_epoch_start", t, self.keras_model, epoch=epoch, logs=t.logs)

    def on_train_batch_begin(self, batch, logs=None):
        fire(self.trainer.callbacks, "train_batch_start", self.trainer, self.keras_model,
             batch=None, batch_idx=self.offset + batch, logs=logs)

    def on_train_batch_end(self, batch, logs=None):
        t, index = self.trainer, self.offset + batch
        last = index + 1 == t.num_training_batches
        t.last_batch_size = self.samples - index * self.size if last else self.size
        t.progress_step = t.current_epoch * t.num_training_batches + index + 1
        t.global_step += 1
        logs = {k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0}
        self.batch_logs = logs
        fire(t.callbacks, "train_batch_end", t, self.keras_model, outputs=logs, batch=None,
             batch_idx=index, logs=logs)
        if self.watch.should_stop():  # collective: every rank stops after this step
            self.stop_at = index + 1
            t.train_sums = self.sums(logs, self.stop_at)
            self.keras_model.stop_training = True

    def _stopping(self) -> bool:
        # Keras still validates and ends the epoch after a stop inside it; the epoch
        # is not over, so none of that reaches the Trainer.
        return self.stop_at is not None

    def on_test_begin(self, logs=None):
        if not self._stopping():
            fire(self.trainer.callbacks, "validation_start", self.trainer, self.keras_model,
                 logs=self.trainer.logs)
            fire(self.trainer.callbacks, "validation_epoch_start", self.trainer, self.keras_model)

    def on_test_batch_end(self, batch, logs=None):
        if not self._stopping():
            logs = {k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0}
            fire(self.trainer.callbacks, "validation_batch_end", self.trainer, self.keras_model,
                 outputs=logs, batch=None, batch_idx=batch)

    def on_test_end(self, logs=None):
        if not self._stopping():
            fire(self.trainer.callbacks, "validation_epoch_end", self.trainer, self.keras_model)
            fire(self.trainer.callbacks, "validation_end", self.trainer, self.keras_model,
                 logs=self.trainer.logs)

    def on_epoch_end(self, epoch, logs=None):
        if self._stopping():
            return
        t, logs_in = self.trainer, logs
        logs = {k: float(v) for k, v in (logs or {}).items()}
        train = {k: v for k, v in logs.items() if not k.startswith("val_")}
        if self.offset:  # resumed mid-epoch: this call saw the epoch's last batches only
            train = {k: s / n for k, (s, n) in
                     self.sums(train, t.num_training_batches).items() if n}
        t.logs.update({**logs, **train})
        # MetricAveraging weighs each rank's value by its sample count, as for torch:
        # training shards are padded to one size, validation shards may differ by one.
        t.train_sums = {
            k: (v * (self.val_samples if k.startswith("val_") else 1),
                self.val_samples if k.startswith("val_") else 1)
            for k, v in t.logs.items() if isinstance(v, (int, float))}
        fire(t.callbacks, "train_epoch_end", t, self.keras_model, epoch=epoch, logs=t.logs)
        t.history.append({"epoch": epoch, **t.logs})
        t.epochs_completed += 1
        if logs_in is not None:
            logs_in.update(t.logs)  # Keras' own History sees the averaged values
        if t.should_stop:
            self.keras_model.stop_training = True

    def end(self) -> None:
        """After the last epoch: the Trainer's train_end and fit_end."""
        t = self.trainer
        fire(t.callbacks, "train_end", t, self.keras_model, logs=t.history.last)
        fire(t.callbacks, "fit_end", t, self.keras_model)


def _bridge(trainer, model, samples: int, size: int, val_samples: int, watch):
    """A keras Callback with :class:`_BridgeHooks`' hooks (Keras is imported lazily)."""
    import keras

    class _Bridge(_BridgeHooks, keras.callbacks.Callback):
        pass

    return _Bridge(trainer, model, samples, size, val_samples, watch)


# ---------------------------------------------------------------------- resume state

def _seed_variables(model) -> list:
    """The model's random-seed states (dropout etc.): variables that are not weights."""
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def _build_optimizer(model) -> None:
    import keras

    optimizer = model.optimizer
    if not optimizer.built:
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(model.trainable_variables)


def optimizer_state(model) -> Dict[str, list]:
    """What a Keras model's checkpoint holds besides its weights (``keras_optimizer``):
    the optimizer's variables (step count, learning rate, slots) and the seed states."""
    _build_optimizer(model)
    return {"optimizer": [np.asarray(v) for v in model.optimizer.variables],
            "seeds": [np.asarray(v) for v in _seed_variables(model)]}


def _assign(variables: list, values: list, what: str, path: str) -> None:
    shapes = [tuple(np.shape(v)) for v in values]
    if shapes != [tuple(v.shape) for v in variables]:
        raise ConfigError(f"The checkpoint {path} does not fit this model's {what} "
                          f"({len(values)} saved, {len(variables)} here); resume with the "
                          f"model and optimizer it was saved from. Received: {shapes[:4]}...")
    for variable, value in zip(variables, values):
        variable.assign(value)


def _restore(trainer, model, watch, sample) -> Optional[dict]:
    """Loads the checkpoint to resume from (:func:`bpstrain.trainer._resume.load`): the
    weights, the optimizer's variables, the seed states and the Trainer's progress.
    ``sample``: one input batch, to build a model that is built lazily."""
    from bpstrain.keras.callbacks import _model_is_built

    loaded = _resume.load(trainer, watch)
    if loaded is None:
        return None
    path, ckpt = loaded
    state = ckpt.get("keras_optimizer")
    if state is None:
        raise ConfigError(f"The checkpoint {path} holds no Keras model state (written by a "
                          "torch module's fit?); resume a Keras model from its own "
                          f"checkpoint. Received: trainer.resume={trainer.config.trainer.resume!r}")
    if not _model_is_built(model):
        model(sample)
    _assign(model.weights, list(ckpt["model"]), "weights", path)
    _build_optimizer(model)
    _assign(model.optimizer.variables, state["optimizer"], "optimizer variables", path)
    _assign(_seed_variables(model), state["seeds"], "seed states", path)
    _resume.restore_progress(trainer, model, path, ckpt)
    return ckpt


def _epoch_order(samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """This rank's sample order in ``epoch``: a function of the seed and the epoch, so
    a resumed run draws the batches the interrupted one would have."""
    if not shuffle:
        return np.arange(samples)
    return np.random.default_rng([seed, epoch]).permutation(samples)


def fit_keras(trainer, model, data: Any, val_data: Any) -> History:
    """Trains a Keras model on this rank's shard with ``model.fit``; returns the history.

    Raises:
        bpstrain.trainer.Preempted: After the checkpoint SIGUSR1 asked for
            (:mod:`bpstrain.trainer._preempt`).
    """
    with _preempt.Watch(trainer, _preempt.mode(trainer.config)) as watch:
        return _fit_keras(trainer, model, data, val_data, watch)


def _fit_keras(trainer, model, data: Any, val_data: Any, watch) -> History:
    from bpstrain.keras import BytePSCallback

    cfg = trainer.config
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
    trainer.num_val_batches = math.ceil(len(validation[0]) / batch) if validation else 0
    seed, shuffle = int(cfg.trainer.seed), bool(cfg.data.shuffle)
    with precision_policy(model, str(cfg.trainer.precision)):
        _compile(model, cfg, trainer.size, compression=trainer.comm.compression_policy())
        ckpt = _restore(trainer, model, watch, x[:1])
        _compression_state.restore(trainer, ckpt)  # each rank its own residuals
        bridge = _bridge(trainer, model, len(x), batch,
                         len(validation[0]) if validation is not None else 0, watch)
        # Our MetricAveraging averages the logs (so torch and Keras behave the same).
        keras_callbacks = [BytePSCallback(average_metrics=False), bridge]
        every = max(int(cfg.trainer.val_every), 1)
        for epoch in range(trainer.current_epoch, trainer.max_epochs):
            start, trainer.resume_batch = trainer.resume_batch, 0
            bridge.begin_epoch(start, trainer.resume_sums if start else {})
            # One model.fit per epoch on the epoch's order: a mid-epoch resume starts at
            # the next batch of the same order.
            index = _epoch_order(len(x), seed, epoch, shuffle)[start * batch:]
            model.fit(x[index], y[index], batch_size=batch, epochs=epoch + 1,
                      initial_epoch=epoch, shuffle=False, callbacks=keras_callbacks,
                      validation_data=validation if (epoch + 1) % every == 0 else None,
                      verbose=0)
            if bridge.stop_at is not None:
                _preempt.save_and_stop(trainer, watch, epoch, bridge.stop_at,
                                       types.SimpleNamespace(seed=seed, shuffle=shuffle))
            if trainer.should_stop:
                break
        bridge.end()
    return trainer.history


# ------------------------------------------------------------------------ evaluation

def _evaluation_setup(trainer, model) -> None:
    """Compiles an uncompiled model from the config and gives every rank rank 0's weights."""
    from bpstrain.keras.callbacks import _model_is_built, broadcast_variables

    trainer.module = model
    _compile(model, trainer.config, trainer.size, training=False)
    if trainer.size > 1 and _model_is_built(model):
        broadcast_variables(model.variables, 0, "trainer.evaluate.weights")


def evaluate_keras(trainer, model, data: Any, stage: str) -> Dict[str, float]:
    """``val_*`` (stage "validate") or ``test_*`` metrics: ``model.evaluate`` on this
    rank's strided shard, each metric weighted by the shard's size and averaged over ranks.
    """
    if data is None:
        raise ValueError(f"{stage}() needs data. Received: data=None")
    x, y = _arrays(data, "data")
    _evaluation_setup(trainer, model)
    xs, ys = x[trainer.rank::trainer.size], y[trainer.rank::trainer.size]
    count = len(xs)
    if count == 0:  # evaluate one sample anyway (same metric names on every rank), weight 0
        xs, ys = x[:1], y[:1]
    with precision_policy(model, str(trainer.config.trainer.precision)):
        logs = model.evaluate(xs, ys, batch_size=int(trainer.config.trainer.batch_size),
                              verbose=0, return_dict=True)
    prefix = "val_" if stage == "validate" else "test_"
    sums = {prefix + k: (float(v) * count, float(count)) for k, v in logs.items()
            if np.ndim(v) == 0}
    trainer.logs = {}
    average_sums(trainer, sums, prefix.rstrip("_"))
    return {k: trainer.logs[k] for k in sums}


def predict_keras(trainer, model, data: Any) -> np.ndarray:
    """``model.predict`` of this rank's strided shard of the inputs (all of them in one
    process); ``data`` is an array of inputs, an ``(x, y)`` pair or a callable."""
    if callable(data):
        data = data()
    if data is None:
        raise ValueError("predict() needs data. Received: data=None")
    x = np.asarray(data[0] if isinstance(data, (tuple, list)) and len(data) == 2 else data)
    _evaluation_setup(trainer, model)
    xs = x[trainer.rank::trainer.size]
    with precision_policy(model, str(trainer.config.trainer.precision)):
        batch = int(trainer.config.trainer.batch_size)
        if len(xs) == 0:
            return model.predict(x[:1], batch_size=batch, verbose=0)[:0]
        return model.predict(xs, batch_size=batch, verbose=0)
