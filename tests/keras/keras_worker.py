"""One worker of the multi-process bpstrain.keras test (run by test_keras.py).

``KERAS_BACKEND`` (tensorflow or torch) comes from the environment. Many checks in
one process because importing the backend costs seconds. Each rank prints one
``CHECK {json}`` line per check (name, rank, ok, error); the test reports them.
"""

import os

import keras
import numpy as np

import bpstrain.keras as bps
from bpstrain import engine
from launched_job import report_checks  # this script's folder is on sys.path

BACKEND = os.environ["KERAS_BACKEND"]
STEPS = 4  # batches per epoch in the fit checks


def same_as_rank0(arrays, tag):
    """Raises unless every array is bit-identical to rank 0's."""
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        root = engine.broadcast(a, 0, name=f"check.{tag}.{i}")
        if not np.array_equal(root, a):
            raise AssertionError(f"rank {bps.rank()}: {tag}[{i}] differs from rank 0: "
                                 f"max |diff| = {np.max(np.abs(root - a))}")


def weights(variables):
    return [keras.ops.convert_to_numpy(v) for v in variables]


def small_model(seed):
    # A different start on every rank. (keras.utils.set_random_seed would import
    # TensorFlow even on the torch backend.)
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu", kernel_initializer=init(seed)),
        keras.layers.Dense(1, kernel_initializer=init(seed + 1)),
    ])


def rank_data(r, n_samples=STEPS * 16):
    rng = np.random.default_rng(1000 + r)  # different data on every rank
    x = rng.normal(size=(n_samples, 8)).astype("float32")
    return x, (x.sum(axis=1, keepdims=True) > 0).astype("float32")


class RecordLearningRate(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.at_batch_begin = []

    def on_train_batch_begin(self, batch, logs=None):
        self.at_batch_begin.append(float(keras.ops.convert_to_numpy(
            self.model.optimizer.learning_rate)))


def warmup_lr(initial, n, warmup, epoch_fraction):
    """Horovod's warm-up formula at fractional epoch ``epoch_fraction``."""
    e = epoch_fraction + 1.0 / STEPS
    return initial / n * (e * (n - 1) / warmup + 1)


def check_bytepscallback(r, n):
    model = small_model(seed=r)
    same_before = engine.push_pull(np.array(weights(model.variables)[0]), "check.init",
                                   average=True)
    assert not np.array_equal(same_before, weights(model.variables)[0]), "init should differ"
    initial = 0.02 * n
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.02, momentum=0.9)),
                  loss="binary_crossentropy", metrics=["accuracy"])
    record = RecordLearningRate()
    x, y = rank_data(r)
    history = model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
                        callbacks=[bps.BytePSCallback(warmup_epochs=2, initial_lr=initial),
                                   record])
    same_as_rank0(weights(model.variables), "fit.model")
    same_as_rank0(weights(model.optimizer.variables), "fit.optimizer")
    same_as_rank0([np.array(history.history["loss"]), np.array(history.history["accuracy"])],
                  "fit.history")
    expected_epoch_lr = [warmup_lr(initial, n, 2, e + (STEPS - 1) / STEPS) for e in range(2)]
    expected_epoch_lr += [initial] * 2  # the rate stays where the warm-up ended
    np.testing.assert_allclose(history.history["lr"], expected_epoch_lr, rtol=1e-6)
    expected_batch_lr = [warmup_lr(initial, n, 2, e + b / STEPS)
                         for e in range(2) for b in range(STEPS)]
    np.testing.assert_allclose(record.at_batch_begin[:2 * STEPS], expected_batch_lr, rtol=1e-6)
    np.testing.assert_allclose(record.at_batch_begin[2 * STEPS:], initial, rtol=1e-6)


def check_separate_callbacks(r, n):
    model = small_model(seed=10 + r)
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                                     name="separate"), loss="mse")
    x, y = rank_data(r)
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[
        bps.BroadcastGlobalVariablesCallback(0),
        bps.MetricAverageCallback(),
        bps.LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=1),
        bps.LearningRateScheduleCallback(initial_lr=0.2, multiplier=lambda e: 0.5 ** e,
                                         start_epoch=1),
    ])
    same_as_rank0(weights(model.variables), "callbacks.model")
    same_as_rank0([np.array(history.history["loss"])], "callbacks.history")
    np.testing.assert_allclose(history.history["lr"], [0.2, 0.1, 0.05], rtol=1e-6)


class RecordKernel(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.kernels = []

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(keras.ops.convert_to_numpy(self.model.layers[0].kernel).ravel())


def check_aggregation(r, n, average_aggregated, run_eagerly=False):
    """backward_passes_per_step=4: the kernel moves on every 4th batch, by the sum."""
    lr, passes, batches = 0.1, 4, 8
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")])
    opt = bps.DistributedOptimizer(keras.optimizers.SGD(lr), backward_passes_per_step=passes,
                                   average_aggregated_gradients=average_aggregated,
                                   name=f"aggregation.{average_aggregated}.{run_eagerly}")
    # loss = mean(x . w) over a batch of one, so d loss / d w = x = (rank + 1) * (b + 1).
    model.compile(optimizer=opt, loss=lambda y_true, y_pred: keras.ops.mean(y_pred),
                  run_eagerly=run_eagerly)
    x = np.array([[(r + 1) * (b + 1)] * 4 for b in range(batches)], dtype="float32")
    record = RecordKernel()
    model.fit(x, np.zeros((batches, 1), "float32"), batch_size=1, epochs=1, shuffle=False,
              verbose=0, callbacks=[record])
    mean_rank_factor = (n + 1) / 2
    kernel, expected = np.ones(4), []
    for b in range(batches):
        if b % passes == passes - 1:
            local_sum = sum(range(b + 2 - passes, b + 2))  # sum of (b' + 1) over the window
            step = local_sum / passes if average_aggregated else local_sum
            kernel = kernel - lr * mean_rank_factor * step
        expected.append(kernel.copy())
    np.testing.assert_allclose(np.array(record.kernels), np.array(expected), rtol=1e-6,
                               err_msg=f"average_aggregated={average_aggregated}")
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == batches, opt.iterations


def check_helpers(r, n):
    np.testing.assert_allclose(bps.push_pull(np.float32(r), name="helper.scalar"), (n - 1) / 2)
    v = keras.Variable(np.full((2,), float(r), "float32"))
    bps.broadcast_variables([v], root_rank=n - 1, name="helper.bcast")
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), [n - 1] * 2)


def check_misuse(r, n):
    import pytest

    with pytest.raises(ValueError, match="keras.optimizers.Optimizer"):
        bps.DistributedOptimizer(object())
    wrapped = bps.DistributedOptimizer(keras.optimizers.SGD(0.1), name="misuse")
    with pytest.raises(ValueError, match="already distributed"):
        bps.DistributedOptimizer(wrapped)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        bps.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)
    assert isinstance(wrapped, keras.optimizers.SGD)
    config = wrapped.get_config()
    assert type(wrapped).__name__ == "SGD", type(wrapped)
    assert np.isclose(config["learning_rate"], 0.1), config
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    with pytest.raises(ValueError, match="LearningRateSchedule"):
        bps.callbacks.set_learning_rate(keras.optimizers.SGD(schedule), 0.5)


def check_xla_switched_off(r, n):
    """TF backend: jit_compile=True fails clearly alone and is turned off by BytePSCallback."""
    if BACKEND != "tensorflow":
        return  # jit_compile means torch.compile there; nothing to check
    import warnings

    import pytest

    x, y = rank_data(r)
    model = small_model(seed=20)
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.01), name="xla1"),
                  loss="mse", jit_compile=True)
    with pytest.raises(ValueError, match="jit_compile=False"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model = small_model(seed=21)
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.01), name="xla2"),
                  loss="mse", jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[bps.BytePSCallback()])
    assert model.jit_compile is False
    assert any("turns XLA off" in str(w.message) for w in caught), [str(w) for w in caught]
    same_as_rank0(weights(model.variables), "xla.model")


def lazy_model(seed):
    """The BytePS/Horovod TF2 MNIST shape: a Sequential without an input shape."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.layers.Dense(16, activation="relu", kernel_initializer=init(seed)),
        keras.layers.Dense(1, kernel_initializer=init(seed + 1)),
    ])


def check_lazy_model_broadcast(r, n):
    """A lazily built model trains and ends identical everywhere (it starts different).

    BytePS's callback arguments: ``device=``, warm-up and schedule without ``initial_lr``.
    """
    model = lazy_model(seed=30 + r)
    assert not model.variables, "the model should not be built before fit"
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                     name="lazy"),
                  loss="binary_crossentropy")
    x, y = rank_data(r)
    record = RecordLearningRate()
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[
        bps.BroadcastGlobalVariablesCallback(0, device=""),
        bps.MetricAverageCallback(device=""),
        bps.LearningRateWarmupCallback(warmup_epochs=1, momentum_correction=False,
                                       steps_per_epoch=None, verbose=0),
        bps.LearningRateScheduleCallback(multiplier=0.5, start_epoch=1),
        record,
    ])
    same_as_rank0(weights(model.variables), "lazy.model")
    same_as_rank0(weights(model.optimizer.variables), "lazy.optimizer")
    same_as_rank0([np.array(history.history["loss"])], "lazy.history")
    # Both take the optimizer's rate (0.05): the warm-up reaches it at the end of epoch 0,
    # the schedule halves it from epoch 1.
    expected = [warmup_lr(0.05, n, 1, b / STEPS) for b in range(STEPS)] + [0.025] * STEPS
    np.testing.assert_allclose(record.at_batch_begin, expected, rtol=1e-6)

    one_batch = lazy_model(seed=40 + r)  # an epoch of one batch: broadcast at epoch end
    one_batch.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                                         name="lazy.bytepscallback"),
                      loss="mse")
    one_batch.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0,
                  callbacks=[bps.BytePSCallback()])
    same_as_rank0(weights(one_batch.variables), "lazy.bytepscallback")


def check_tensorflow_keras_module(r, n):
    """TF backend: ``import bpstrain.tensorflow.keras as hvd`` runs Horovod's MNIST script."""
    if BACKEND != "tensorflow":
        return  # the module is TensorFlow's (importing it here would load TF into torch)
    import pytest
    import tensorflow as tf

    import bpstrain.tensorflow as btf
    import bpstrain.tensorflow.keras as hvd

    assert hvd.rank() == r and hvd.size() == n and hvd.local_rank() == bps.local_rank()
    assert hvd.Average is btf.Average and hvd.Compression is btf.Compression
    model = tf.keras.Sequential([  # Horovod's tensorflow2_keras_mnist.py model, smaller
        tf.keras.layers.Conv2D(4, [3, 3], activation="relu",
                               kernel_initializer=keras.initializers.GlorotUniform(r)),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(10, activation="softmax",
                              kernel_initializer=keras.initializers.GlorotUniform(r + 1)),
    ])
    opt = hvd.DistributedOptimizer(tf.optimizers.Adam(0.001 * hvd.size()),
                                   compression=hvd.Compression.fp16,
                                   backward_passes_per_step=1, average_aggregated_gradients=True)
    model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                  metrics=["accuracy"])
    rng = np.random.default_rng(r)
    images = rng.random((4 * 8, 8, 8, 1)).astype("float32")
    labels = rng.integers(0, 10, 4 * 8).astype("int64")
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).repeat().batch(8)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.001 * hvd.size(),
                                                          warmup_epochs=1, verbose=0)]
    model.fit(dataset, steps_per_epoch=4, callbacks=callbacks, epochs=2, verbose=0)
    same_as_rank0(weights(model.variables), "tfkeras.model")
    np.testing.assert_allclose(hvd.allreduce(np.float32(r), op=hvd.Sum, name="tfkeras.sum"),
                               n * (n - 1) / 2)
    np.testing.assert_array_equal(hvd.broadcast(np.full(2, r), n - 1, name="tfkeras.bc"),
                                  [n - 1] * 2)
    with pytest.raises(ValueError, match="always average"):
        hvd.DistributedOptimizer(tf.optimizers.SGD(0.1), op=hvd.Sum)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(tf.optimizers.SGD(0.1), compression=hvd.Compression.fp16,
                                 backward_passes_per_step=2)
    with pytest.raises(NotImplementedError, match="BroadcastGlobalVariablesCallback"):
        hvd.broadcast_global_variables(0)


def check_keras_compression(r, n):
    """Compression.fp16 really sends float16: 1 + 2**-12 arrives as 1.0 (SGD, lr 1)."""
    if BACKEND == "tensorflow":
        from bpstrain.tensorflow import Compression
    else:
        from bpstrain.torch import Compression
    fine = 1.0 + 2.0 ** -12  # exact in float32, rounds to 1.0 in float16
    for compression, expected_step in ((None, fine), (Compression.fp16, 1.0)):
        v = keras.Variable(np.zeros(3, "float32"))
        opt = bps.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=compression,
                                       name=f"compression.{compression is None}")
        opt.apply([keras.ops.convert_to_tensor(np.full(3, fine, "float32"))], [v])
        got = keras.ops.convert_to_numpy(v)
        assert got.dtype == np.float32, got.dtype
        np.testing.assert_array_equal(got, np.full(3, -expected_step, "float32"),
                                      err_msg=f"compression={compression}")


def check_keras_sparse_embedding(r, n):
    """With the TensorFlow backend an Embedding's gradient (IndexedSlices) travels as rows
    (bpstrain._sparse.sparse_push_pull, counted here), in model.fit's tf.function and
    eagerly; every rank ends with the same table, equal to the dense average's step, and
    rows nobody touched stay zero. sparse_as_dense=True (and the torch backend, whose
    gradients are dense) keep the dense path."""
    from bpstrain import _sparse

    calls = []
    original = _sparse.sparse_push_pull

    def counting(*args, **kwargs):
        calls.append(kwargs.get("name", args[2] if len(args) > 2 else None))
        return original(*args, **kwargs)

    _sparse.sparse_push_pull = counting
    try:
        for sparse_as_dense, run_eagerly in ((False, False), (False, True), (True, False)):
            calls.clear()
            model = keras.Sequential([
                keras.Input((3,), dtype="int32"),
                keras.layers.Embedding(50, 4, embeddings_initializer="zeros"),
                keras.layers.Flatten(),
                keras.layers.Dense(1, kernel_initializer="ones", use_bias=False),
            ])
            opt = bps.DistributedOptimizer(keras.optimizers.SGD(0.5), sparse_as_dense=sparse_as_dense,
                                           name=f"emb.{sparse_as_dense}.{run_eagerly}")
            model.compile(optimizer=opt, loss="mse", run_eagerly=run_eagerly)
            ids_of = [np.random.default_rng(77 + k).integers(0, 40, (8, 3)).astype("int32") for k in range(n)]
            model.fit(ids_of[r], np.ones((8, 1), "float32"), batch_size=8, epochs=1, verbose=0, shuffle=False)
            table = keras.ops.convert_to_numpy(model.layers[0].embeddings)
            same_as_rank0([table], f"emb.{sparse_as_dense}.{run_eagerly}")
            # every prediction starts at 0: d(mse)/d(pred) = -2/8 per sample, so each use of a
            # row adds -0.25 to each of its entries; SGD(0.5) on the average over ranks.
            counts = np.bincount(np.concatenate([i.reshape(-1) for i in ids_of]), minlength=50)
            expected = np.repeat((0.5 * 0.25 * counts / n)[:, None], 4, axis=1).astype("float32")
            np.testing.assert_allclose(table, expected, rtol=1e-6, err_msg=f"{sparse_as_dense} {run_eagerly}")
            as_rows = BACKEND == "tensorflow" and not sparse_as_dense
            assert bool(calls) == as_rows, (sparse_as_dense, run_eagerly, calls)
    finally:
        _sparse.sparse_push_pull = original


CHECKS = [
    ("helpers", check_helpers),
    ("bytepscallback_fit", check_bytepscallback),
    ("separate_callbacks_fit", check_separate_callbacks),
    ("aggregation_sum", lambda r, n: check_aggregation(r, n, average_aggregated=False)),
    ("aggregation_average", lambda r, n: check_aggregation(r, n, average_aggregated=True)),
    ("aggregation_run_eagerly",
     lambda r, n: check_aggregation(r, n, average_aggregated=False, run_eagerly=True)),
    ("misuse", check_misuse),
    ("xla_switched_off", check_xla_switched_off),
    ("lazy_model_broadcast", check_lazy_model_broadcast),
    ("tensorflow_keras_module", check_tensorflow_keras_module),
    ("keras_compression", check_keras_compression),
    ("keras_sparse_embedding", check_keras_sparse_embedding),
]


def main():
    bps.init()
    r, n = bps.rank(), bps.size()
    assert keras.backend.backend() == BACKEND, keras.backend.backend()
    report_checks(CHECKS, r, n)
    bps.shutdown()


if __name__ == "__main__":
    main()
