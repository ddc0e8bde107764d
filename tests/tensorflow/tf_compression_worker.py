"""One worker of the 2- and 3-worker compression jobs (run by test_tf_compression.py).

Each check compresses this rank's tensor for a few steps and compares the result with
the reference: the blobs every rank actually sent (recorded, then gathered) put through
``bpstrain._codec.server_round`` (servers' residual included), or for random-k and
PowerSGD a numpy replay of every rank's steps. Every rank can rebuild every rank's
input: it is drawn from a seed that is the rank.
"""

import os
import sys

import numpy as np
import tensorflow as tf

import bpstrain.tensorflow as bps
from bpstrain import _codec
from bpstrain._compression import powersgd_initial_q
from bpstrain.tensorflow import _wire
from bpstrain.tensorflow.compression import Compression

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "keras"))
from launched_job import report_checks  # noqa: E402

SHAPE = (50, 40)  # 2000 elements: blobs of 700, 700 and 600 with chunk=700


def data(rank, step, shape=SHAPE):
    return np.random.default_rng(100 * rank + step).standard_normal(shape).astype(np.float32)


class Recorder:
    """Keeps the byte strings this rank pushes (what the servers receive)."""

    def __init__(self):
        self.sent = []

    def __enter__(self):
        self.original = _wire.submit_compressed

        def record(array, name, priority, partition_bytes):
            self.sent.append(np.asarray(array, np.uint8).copy())
            return self.original(array, name, priority, partition_bytes)

        _wire.submit_compressed = record
        return self

    def __exit__(self, *exc):
        _wire.submit_compressed = self.original


def every_ranks(blob, name):
    """Every rank's byte string of this round, in rank order."""
    rows = bps.allgather(tf.constant(blob[None, :]), name=name).numpy()
    return [row.tobytes() for row in rows]


def blob_check(make, label, graph=False):
    def check(r, n):
        compressor, residuals = make(), {}
        run = compressor.reduce
        if graph:
            run = tf.function(lambda t: compressor.reduce([t], [label])[0])
        for step in range(3):  # the workers' and the servers' residuals carry over
            with Recorder() as rec:
                x = tf.constant(data(r, step))
                out = run(x) if graph else run([x], [label])[0]
            assert len(rec.sent) == 1, len(rec.sent)
            pushes = every_ranks(rec.sent[0], f"{label}.sent.{step}")
            answer = _codec.server_round(pushes, residuals)
            expect = _codec.decode_all(answer).reshape(SHAPE) / np.float32(n)
            if graph:  # Grappler may divide by 3 as a multiplication by 1/3 (one ulp)
                np.testing.assert_allclose(out.numpy(), expect, rtol=2e-7, atol=0,
                                           err_msg=f"step {step}")
            else:
                np.testing.assert_array_equal(out.numpy(), expect, err_msg=f"step {step}")
    return check


def check_overflow(r, n):
    """A step where rank 0's gradient holds inf (an fp16 overflow): every rank gets NaN
    (so a LossScaleOptimizer skips it everywhere), rank 0 sent zeros, and the next steps
    are the servers' rule again (their residual was not poisoned)."""
    compressor, residuals = Compression.onebit(chunk=700), {}
    for step in range(3):
        x = data(r, step)
        if step == 1 and r == 0:
            x[0, 0] = np.inf
        with Recorder() as rec:
            out = compressor.reduce([tf.constant(x)], ["overflow"])[0].numpy()
        pushes = every_ranks(rec.sent[0], f"overflow.sent.{step}")
        answer = _codec.server_round(pushes, residuals)
        if step == 1:
            assert np.isnan(out).all(), out
            assert not _codec.decode_all(pushes[0]).any()  # rank 0 sent zeros
        else:
            expect = _codec.decode_all(answer).reshape(SHAPE) / np.float32(n)
            np.testing.assert_array_equal(out, expect, err_msg=f"step {step}")


def check_randomk(r, n):
    compressor = Compression.randomk(0.1, seed=3)
    size, k = 2000, _codec.topk_count(2000, 0.1)
    residuals = [np.zeros(size, np.float32) for _ in range(n)]
    for step in range(3):
        out = compressor.reduce([tf.constant(data(r, step))], ["rk"])[0].numpy().ravel()
        idx = _codec.randomk_indices(size, k, 3, "rk", step)
        values = []
        for rank in range(n):  # replay every rank's error feedback
            flat = data(rank, step).ravel() + residuals[rank]
            values.append(flat[idx].copy())
            flat[idx] = 0
            residuals[rank] = flat
        expect = np.zeros(size, np.float32)
        expect[idx] = np.sum(values, axis=0, dtype=np.float32) / np.float32(n)
        # Plain float32 sums: the servers add in arrival order (last-bit differences).
        np.testing.assert_allclose(out, expect, rtol=1e-6, atol=1e-7, err_msg=f"step {step}")
        assert np.count_nonzero(out) <= k


def check_powersgd(r, n):
    compressor = Compression.powersgd(2)
    q = powersgd_initial_q(40, 2, 0, "ps")
    residuals = [np.zeros(SHAPE, np.float64) for _ in range(n)]
    for step in range(3):
        out = compressor.reduce([tf.constant(data(r, step)), tf.ones(5)], ["ps", "bias"])
        ms = [data(rank, step).astype(np.float64) + residuals[rank] for rank in range(n)]
        p = np.linalg.qr(np.mean([m @ q for m in ms], axis=0))[0]
        q = np.mean([m.T @ p for m in ms], axis=0)
        approx = p @ q.T  # invariant to the signs QR gives P's columns
        residuals = [m - approx for m in ms]
        np.testing.assert_allclose(out[0].numpy(), approx, atol=1e-4, err_msg=f"step {step}")
        np.testing.assert_array_equal(out[1].numpy(), np.ones(5))  # 1-D: plain average


def check_server_state(r, n):
    """get_state(server_state=True) then set_state into a fresh compressor: the next step
    equals the uninterrupted one's, the servers' residuals included."""
    first = Compression.topk(0.05, chunk=700)
    for step in range(2):
        first.reduce([tf.constant(data(r, step))], ["ss"])
    state = first.get_state(server_state=True)  # collective
    assert sorted(state) == ["residual/ss", "server/ss"], sorted(state)
    assert np.abs(state["server/ss"]).sum() > 0  # the servers did keep something
    want = first.reduce([tf.constant(data(r, 2))], ["ss"])[0].numpy()
    second = Compression.topk(0.05, chunk=700)
    second.set_state(state)  # collective: the servers' residual goes back
    got = second.reduce([tf.constant(data(r, 2))], ["ss"])[0].numpy()
    np.testing.assert_array_equal(got, want)


def check_keras_onebit_fit(r, n):
    import keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(r)
    x = rng.standard_normal((512, 8)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(2)])
    compression = Compression.policy("onebit", min_size=0)  # the model's tensors are small
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.05),
                                                     compression=compression),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(x, y, batch_size=32, epochs=4, verbose=0,
                        callbacks=[bps.keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    losses = history.history["loss"]
    assert losses[-1] < 0.7 * losses[0], losses
    assert history.history["accuracy"][-1] > 0.85, history.history
    assert len(compression.get_state()) == 4  # a residual per variable
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    total = bps.push_pull(tf.constant(flat), average=False, name="keras.weights").numpy()
    np.testing.assert_allclose(total, n * flat, rtol=1e-6)  # every rank holds the same weights


if __name__ == "__main__":
    import bpstrain.tensorflow.keras  # noqa: F401  (bps.keras.callbacks)

    bps.init()
    checks = [
        ("onebit", blob_check(lambda: Compression.onebit(chunk=700), "onebit")),
        ("onebit_unscaled", blob_check(lambda: Compression.onebit(False, chunk=700), "onebit_u")),
        ("topk", blob_check(lambda: Compression.topk(0.05, chunk=700), "topk")),
        ("dithering", blob_check(lambda: Compression.dithering(8, chunk=700), "dithering")),
        ("overflow", check_overflow),
        ("randomk", check_randomk),
        ("powersgd", check_powersgd),
        ("graph_mode", blob_check(lambda: Compression.topk(0.05, chunk=700), "graph", True)),
        ("server_state", check_server_state),
        ("keras_onebit_fit", check_keras_onebit_fit),
    ]
    report_checks(checks, bps.rank(), bps.size())
    bps.shutdown()
