"""One worker of the multi-process bpstrain.tensorflow test (run by test_tensorflow.py).

Many checks in one process because importing TensorFlow costs seconds. Every rank
runs the same sequence of collective calls and prints one ``CHECK {json}`` line per
check (name, rank, ok, error); the test reports them one by one.
"""

import os
import sys

import numpy as np
import tensorflow as tf

import bpstrain.tensorflow as bps
from bpstrain.tensorflow import _ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "keras"))
from launched_job import report_checks  # noqa: E402

DTYPES = [tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32,
          tf.float64]


def expect(actual, expected, what):
    actual = np.asarray(actual, dtype=np.float64)
    if not np.array_equal(actual, np.asarray(expected, dtype=np.float64)):
        raise AssertionError(f"rank {bps.rank()}: {what}: expected {expected}, got {actual}")


def check_dtypes(r, n):
    base = np.arange(6, dtype=np.float64).reshape(2, 3)
    total = n * base + n * (n - 1) / 2  # sum over ranks of base + rank
    root = min(1, n - 1)

    @tf.function
    def in_graph(t, names):
        # One trace per dtype: derived names would collide, so name them.
        return bps.push_pull(t, average=True, name=names + ".avg"), \
            bps.push_pull(t, average=False, name=names + ".sum"), \
            bps.broadcast(t, root, name=names + ".bcast")

    for dtype in DTYPES:
        t = tf.cast(tf.constant(base + r), dtype)
        is_int = dtype.is_integer
        mean = total // n if is_int else total / n  # integers: floor division
        eager = (bps.push_pull(t), bps.push_pull(t, average=False), bps.broadcast(t, root))
        for mode, outs in (("eager", eager), ("graph", in_graph(t, f"dtype.{dtype.name}"))):
            for out in outs:
                assert out.dtype == dtype and out.shape == (2, 3), (mode, dtype, out)
            expect(outs[0], mean, f"{mode} average {dtype.name}")
            expect(outs[1], total, f"{mode} sum {dtype.name}")
            expect(outs[2], base + root, f"{mode} broadcast {dtype.name}")


def check_graph_names(r, n):
    @tf.function
    def scalars(x):
        return bps.push_pull(x * 2.0, average=False), bps.broadcast(x + 1.0, 0)

    def eager_number():
        name = _ops.tensor_name("push_pull", tf.constant(1.0), None)
        assert name.startswith("tf.push_pull.noname."), name
        return int(name.rsplit(".", 1)[1])

    before = eager_number()
    for _ in range(3):
        total, root = scalars(tf.constant(float(r)))
        expect(total, n * (n - 1), "unnamed scalar sum in tf.function")
        expect(root, 1.0, "unnamed scalar broadcast in tf.function")
    # Derived from the graph (same every call), not from the eager counter.
    assert eager_number() == before + 1, "graph calls must not consume eager names"


def check_gradients(r, n):
    mean_weight = (n + 1) / 2  # average over ranks of (rank + 1)
    x = tf.Variable(tf.ones(2) * (r + 1))

    def grads(average, root=None):
        with tf.GradientTape() as tape:
            y = bps.push_pull(x, average=average) if root is None else bps.broadcast(x, root)
            loss = tf.reduce_sum(y * (r + 1))
        return tape.gradient(loss, x)

    graph_grads = tf.function(grads)
    for mode, fn in (("eager", grads), ("graph", graph_grads)):
        expect(fn(True), [mean_weight] * 2, f"{mode} d push_pull(average)")
        expect(fn(False), [n * mean_weight] * 2, f"{mode} d push_pull(sum)")
        root = n - 1
        expect(fn(None, root), [n * mean_weight if r == root else 0] * 2, f"{mode} d broadcast")


def check_variables_and_tape(r, n):
    v = tf.Variable(tf.fill([3], float(r)), name="bcast_me")
    bps.broadcast_variables([v], root_rank=n - 1)
    expect(v, [n - 1] * 3, "eager broadcast_variables")
    w = tf.Variable(tf.fill([2, 2], float(10 + r)), name="bcast_graph")
    tf.function(lambda: bps.broadcast_variables([w], root_rank=0))()
    expect(w, np.full((2, 2), 10), "graph broadcast_variables")

    unused = tf.Variable(1.0, name="unused")

    def tape_grads(variables):
        with tf.GradientTape() as tape:
            loss = (r + 1) * tf.reduce_sum(variables[0])
        tape = bps.DistributedGradientTape(tape)
        assert isinstance(tape, tf.GradientTape)
        return tape.gradient(loss, variables)

    for mode, fn in (("eager", tape_grads), ("graph", tf.function(tape_grads))):
        g, none = fn([w, unused])
        expect(g, np.full((2, 2), (n + 1) / 2), f"{mode} DistributedGradientTape")
        assert none is None, f"{mode}: an unconnected gradient must stay None"


def check_optimizers(r, n):
    import keras

    w = tf.Variable(tf.ones(4), name="w_keras")
    opt = bps.DistributedOptimizer(keras.optimizers.SGD(0.5))

    @tf.function
    def step():
        opt.apply_gradients([(tf.fill([4], float(r + 1)), w)])

    step()
    expect(w, [1 - 0.5 * (n + 1) / 2] * 4, "keras SGD via bpstrain.tensorflow in tf.function")

    w1 = tf.Variable(tf.ones(3), name="w_v1")
    v1 = bps.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
    v1.minimize(lambda: (r + 1) * tf.reduce_sum(w1), var_list=[w1])
    expect(w1, [1 - 0.5 * (n + 1) / 2] * 3, "tf.compat.v1 optimizer")


def check_mismatch(r, n):
    from bpstrain.errors import MismatchError

    for what, tensor in (("shape", tf.zeros([r + 1])),
                         ("dtype", tf.zeros([2], tf.float32 if r == 0 else tf.float64))):
        try:
            bps.push_pull(tensor, name=f"mismatch.eager.{what}")
        except MismatchError as exc:
            assert "disagrees across ranks" in str(exc), exc
        else:
            raise AssertionError(f"eager {what} mismatch did not raise")

    @tf.function
    def graph(t):
        return bps.push_pull(t, name="mismatch.graph")

    try:
        graph(tf.zeros([2, r + 1]))
    except tf.errors.UnknownError as exc:
        assert "MismatchError" in str(exc) and "disagrees across ranks" in str(exc), exc
    else:
        raise AssertionError("graph mismatch did not raise")
    # The job stays usable.
    expect(bps.push_pull(tf.ones([2]), name="after.mismatch", average=False), [n, n], "after")


def check_custom_loop(r, n):
    """The module docstring's loop: after a few steps every weight equals rank 0's."""
    import keras

    init = keras.initializers.GlorotUniform
    model = keras.Sequential([keras.Input((5,)),
                              keras.layers.Dense(8, "relu", kernel_initializer=init(r)),
                              keras.layers.Dense(1, kernel_initializer=init(r + 50))])
    opt = keras.optimizers.Adam(0.01)
    opt.build(model.trainable_variables)
    bps.broadcast_variables(model.variables, root_rank=0)
    bps.broadcast_variables(opt.variables, root_rank=0)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        tape = bps.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    rng = np.random.default_rng(r)
    for _ in range(3):
        step(rng.normal(size=(4, 5)).astype("float32"), rng.normal(size=(4, 1)).astype("float32"))
    for i, v in enumerate(model.variables + opt.variables):
        local = np.asarray(v.numpy())
        root = bps.broadcast(tf.constant(local), 0, name=f"custom_loop.check.{i}").numpy()
        assert np.array_equal(local, root), f"variable {v.path} differs from rank 0's"


def check_xla_refused(r, n):
    @tf.function(jit_compile=True)
    def compiled(t):
        return bps.push_pull(t, name="never.sent")

    try:
        compiled(tf.ones([2]))
    except ValueError as exc:
        assert "jit_compile" in str(exc), exc
    else:
        raise AssertionError("push_pull under XLA did not raise")


def check_ops_and_compression(r, n):
    """op=Sum/Average, Compression.fp16 (really float16 on the wire), Horovod signatures."""
    import pytest

    mine = tf.fill([2], float(r + 1))
    expect(bps.push_pull(mine, op=bps.Sum, name="op.sum"), [n * (n + 1) / 2] * 2, "op=Sum")
    expect(bps.push_pull(mine, op=bps.Average, name="op.avg"), [(n + 1) / 2] * 2, "op=Average")
    with pytest.raises(ValueError, match="not both"):
        bps.push_pull(mine, average=True, op=bps.Sum)
    with pytest.raises(ValueError, match="Average or Sum"):
        bps.push_pull(mine, op="Adasum")
    with pytest.raises(ValueError, match="compress"):
        bps.push_pull(mine, compression=3)
    # A spec string names a compressor, as bpstrain.torch's optimizer takes it.
    expect(bps.push_pull(mine, compression="fp16", name="comp.spec"), [(n + 1) / 2] * 2,
           "compression='fp16'")

    fine = 1.0 + 2.0 ** -12  # exact in float32, 1.0 in float16
    x = tf.constant([fine, 3.0])
    plain = bps.push_pull(x, name="comp.none")
    small = bps.push_pull(x, name="comp.fp16", compression=bps.Compression.fp16)
    assert small.dtype == tf.float32, small.dtype
    expect(plain, [fine, 3.0], "no compression")
    expect(small, [1.0, 3.0], "fp16 compression")

    v = tf.Variable([1.0, 2.0])

    @tf.function
    def summed_fp16_grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * tf.constant([fine, float(r + 1)]))
        tape = bps.DistributedGradientTape(tape, compression=bps.Compression.fp16, op=bps.Sum,
                                           device_dense="", device_sparse="",
                                           sparse_as_dense=True, name="comp.tape")
        return tape.gradient(loss, [v])[0]

    expect(summed_fp16_grads(), [n, n * (n + 1) / 2], "tape op=Sum, fp16")

    v1 = tf.compat.v1.train.GradientDescentOptimizer(1.0)
    dist = bps.DistributedOptimizer(v1, op=bps.Sum, compression=bps.Compression.fp16,
                                    name="comp.v1")
    w = tf.Variable([0.0])
    dist.apply_gradients(dist.compute_gradients(lambda: tf.reduce_sum(w * fine), [w]))
    expect(w.numpy(), [-n * 1.0], "v1 optimizer op=Sum, fp16")


def check_allgather(r, n):
    """Horovod's allgather: ranks' rows in rank order (different row counts), eager, in a
    tf.function, its gradient, the tf.keras module's numpy form, and the errors."""
    import pytest

    import bpstrain.tensorflow.keras as hvd_keras

    rows = [k + 1 for k in range(n)]  # rank k has k + 1 rows
    every = np.concatenate([np.full((rows[k], 2), float(k)) for k in range(n)])
    for dtype in (tf.float32, tf.int64, tf.bfloat16):
        out = bps.allgather(tf.cast(tf.fill([r + 1, 2], float(r)), dtype))
        assert out.dtype == dtype and out.shape == every.shape, (dtype, out)
        expect(out, every, f"eager allgather {dtype.name}")
    # Rank 0 has no rows at all: nothing to send from it.
    expect(bps.allgather(tf.fill([r, 3], float(r)), name="ag.empty0"),
           np.concatenate([np.full((k, 3), float(k)) for k in range(n)]), "allgather, 0 rows on rank 0")

    @tf.function
    def in_graph(x):
        return bps.allgather(x * 2.0)

    for _ in range(2):  # the derived name is used again, round after round
        out = in_graph(tf.fill([r + 1, 2], float(r)))
        assert out.shape.as_list() == list(every.shape), out.shape
        expect(out, 2 * every, "allgather in tf.function")

    # The gradient of rank r's rows: its rows of the sum over ranks of the upstream gradient.
    offset = sum(rows[:r])
    x = tf.Variable(tf.ones([r + 1, 2]))
    weight = tf.constant(np.arange(every.shape[0], dtype=np.float32)[:, None] * (r + 1))

    def grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(bps.allgather(x, name="ag.grad") * weight)
        return tape.gradient(loss, x)

    wanted = np.arange(offset, offset + r + 1)[:, None] * (n * (n + 1) / 2) * np.ones((1, 2))
    expect(grads(), wanted, "eager d allgather")
    expect(tf.function(grads)(), wanted, "graph d allgather")

    expect(hvd_keras.allgather([float(r)]), np.arange(n), "tf.keras allgather")
    with pytest.raises(ValueError, match="at least one dimension"):
        bps.allgather(tf.constant(1.0))
    with pytest.raises(NotImplementedError, match="process_set"):
        bps.allgather(tf.ones([1]), process_set=object())


def check_sparse_rows(r, n):
    """IndexedSlices gradients travel as rows and come back as IndexedSlices of the union,
    equal to the dense average (exact sums: small integers); eager and in a tf.function;
    sparse_as_dense keeps the dense path."""
    table = tf.Variable(tf.zeros([1000, 4]))
    ids = tf.constant(np.random.default_rng(r).integers(0, 1000, 12), tf.int64)
    weight = tf.constant(np.full((12, 4), r + 1, np.float32))

    def grads(sparse_as_dense=False, name="sparse.tape"):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids) * weight)
        tape = bps.DistributedGradientTape(tape, name=name, sparse_as_dense=sparse_as_dense)
        return tape.gradient(loss, table)

    all_ids = np.unique(np.concatenate([np.random.default_rng(k).integers(0, 1000, 12) for k in range(n)]))
    dense_sum = np.zeros((1000, 4))
    for k in range(n):
        np.add.at(dense_sum, np.random.default_rng(k).integers(0, 1000, 12), float(k + 1))
    average = dense_sum.astype(np.float32) * (np.float32(1.0) / np.float32(n))  # the engine's rule
    for g in (grads(), tf.function(grads)()):
        assert isinstance(g, tf.IndexedSlices), type(g)
        expect(np.sort(g.indices.numpy()), all_ids, "the union of the touched rows")
        expect(tf.convert_to_tensor(g), average, "rows averaged")
    dense = grads(sparse_as_dense=True, name="sparse.dense")
    expect(tf.convert_to_tensor(dense), average, "sparse_as_dense")


CHECKS = [
    ("sparse_rows", check_sparse_rows),
    ("dtypes", check_dtypes),
    ("graph_names", check_graph_names),
    ("gradients", check_gradients),
    ("variables_and_tape", check_variables_and_tape),
    ("optimizers", check_optimizers),
    ("mismatch", check_mismatch),
    ("custom_loop", check_custom_loop),
    ("xla_refused", check_xla_refused),
    ("ops_and_compression", check_ops_and_compression),
    ("allgather", check_allgather),
]


def main():
    bps.init()
    r, n = bps.rank(), bps.size()
    assert 0 <= bps.local_rank() < bps.local_size() and n >= 2, (r, n)
    report_checks(CHECKS, r, n)
    bps.shutdown()


if __name__ == "__main__":
    main()
