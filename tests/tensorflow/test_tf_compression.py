"""bpstrain.tensorflow's compressors: byte-identical to the numpy reference
(bpstrain._codec), state that saves and restores, and real 2- and 3-worker jobs whose
results equal the servers' rule applied to the blobs the workers actually sent.

The in-process tests run on a standalone engine (rank 0 of 1); the job runs every
multi-worker check in one launch (tf_compression_worker.py), as test_tensorflow.py does.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from bpstrain import _codec, engine  # noqa: E402
from bpstrain._compression import powersgd_initial_q  # noqa: E402
from bpstrain.tensorflow import _wire  # noqa: E402
from bpstrain.tensorflow.compression import (Compression, PolicyCompressor,  # noqa: E402
                                             check_compression, from_spec)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "keras"))
from launched_job import assert_check, launch  # noqa: E402

from tests.dgc_reference import dgc_steps, top  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _data(n, seed=0):
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    x[::7] = np.round(x[::7])  # equal magnitudes: top-k's tie-break matters
    x[3::11] = -0.0
    return x


def _reference(codec, x, chunk, **kw):
    """The reference byte string of ``x``: one _codec.encode per chunk."""
    out, start = [], 0
    for n in _codec.chunk_sizes(x.size, chunk):
        part = x[start:start + n]
        k = _codec.topk_count(n, kw.get("ratio", 0)) if codec == _codec.TOPK else 0
        out.append(_codec.encode(codec, part, scaled=kw.get("scaled", True),
                                 levels=kw.get("levels", 0), k=k,
                                 server_ef=kw.get("server_ef", True),
                                 u=None if kw.get("u") is None else kw["u"][start:start + n]))
        start += n
    return b"".join(out)


CODECS = [
    ("onebit", _codec.ONEBIT, dict(scaled=True)),
    ("onebit-unscaled", _codec.ONEBIT, dict(scaled=False)),
    ("onebit-no-server-ef", _codec.ONEBIT, dict(scaled=True, server_ef=False)),
    ("topk", _codec.TOPK, dict(ratio=0.1)),
    ("topk-all", _codec.TOPK, dict(ratio=1.0)),
    ("dithering", _codec.DITHERING, dict(levels=7)),
    ("dithering-1", _codec.DITHERING, dict(levels=1)),
]


@pytest.mark.parametrize("numel", [1, 9, 64, 1000])
@pytest.mark.parametrize("label,codec,kw", CODECS, ids=[c[0] for c in CODECS])
def test_encoding_is_byte_identical_to_the_reference_and_decodes_alike(label, codec, kw, numel):
    x = _data(numel)
    layout = _wire.Layout(codec, numel, chunk=128, ratio=kw.get("ratio", 0.0),
                          levels=kw.get("levels", 0), scaled=kw.get("scaled", True),
                          server_ef=kw.get("server_ef", True))
    blob = _wire.encode(layout, tf.constant(x)).numpy().tobytes()
    assert blob == _reference(codec, x, 128, **kw)
    assert len(blob) == layout.nbytes
    decoded = _wire.decode(layout, tf.constant(np.frombuffer(blob, np.uint8))).numpy()
    np.testing.assert_array_equal(decoded, _codec.decode_all(blob))
    # The servers' answer has the same layout: what a server sends back decodes too.
    answer = _codec.server_round([blob, blob])
    decoded = _wire.decode(layout, tf.constant(np.frombuffer(answer, np.uint8))).numpy()
    np.testing.assert_array_equal(decoded, _codec.decode_all(answer))


def test_stochastic_dithering_matches_the_reference_given_the_same_uniforms():
    x = _data(300, seed=3)
    u = np.random.default_rng(5).random(300)
    layout = _wire.Layout(_codec.DITHERING, 300, chunk=128, levels=4)
    taken = iter([u[:128], u[128:256], u[256:]])
    blob = _wire.encode(layout, tf.constant(x), lambda n: tf.constant(next(taken))).numpy()
    assert blob.tobytes() == _reference(_codec.DITHERING, x, 128, levels=4, u=u)


def test_degenerate_chunks_encode_as_the_reference():
    for x in (np.zeros(10, np.float32), np.full(10, np.inf, np.float32)):
        for codec, kw in ((_codec.DITHERING, dict(levels=3)), (_codec.ONEBIT, {})):
            layout = _wire.Layout(codec, 10, levels=kw.get("levels", 0))
            assert _wire.encode(layout, tf.constant(x)).numpy().tobytes() == \
                _reference(codec, x, _codec.DEFAULT_CHUNK, **kw)


def test_momentum_correction_needs_the_keras_optimizers_momentum_to_match():
    import keras

    import bpstrain.tensorflow as bps

    bps.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                             compression=Compression.topk(0.01, momentum=0.9))
    for wrong, words in [(keras.optimizers.SGD(0.1), "Received: momentum=0.0"),
                         (keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True), "nesterov=True"),
                         (keras.optimizers.Adam(), "momentum=None")]:
        with pytest.raises(ValueError, match="momentum correction") as err:
            bps.DistributedOptimizer(wrong, compression=Compression.topk(0.01, momentum=0.9))
        assert words in str(err.value)


@pytest.mark.usefixtures("standalone_engine")
@pytest.mark.parametrize("make", [lambda: Compression.onebit(chunk=100),
                                  lambda: Compression.topk(0.05, chunk=100),
                                  lambda: Compression.dithering(5, stochastic=False, chunk=100)],
                         ids=["onebit", "topk", "dithering"])
def test_worker_error_feedback_keeps_what_the_blob_dropped(make):
    compressor = make()
    x = tf.constant(_data(250).reshape(10, 25))
    sent = []
    original = _wire.submit_compressed

    def record(array, name, priority, partition_bytes):
        sent.append((bytes(np.asarray(array, np.uint8)), partition_bytes))
        return original(array, name, priority, partition_bytes)

    _wire.submit_compressed, before = record, _wire.submit_compressed
    try:
        first = compressor.reduce([x], ["g"])[0]
        residual = compressor.get_state()["residual/g"]
        second = compressor.reduce([x], ["g"])[0]
    finally:
        _wire.submit_compressed = before
    blob0, partition = sent[0]
    assert partition == compressor.layout(250).blob_sizes[0]  # partitions hold whole blobs
    # Alone, the engine answers the blob itself: the result is its decoding.
    np.testing.assert_array_equal(first.numpy().ravel(), _codec.decode_all(blob0))
    np.testing.assert_allclose(residual, x.numpy().ravel() - _codec.decode_all(blob0), atol=1e-6)
    # Step 2 compresses the gradient plus that residual.
    expect = _reference(compressor.codec, x.numpy().ravel() + residual, 100,
                        ratio=getattr(compressor, "ratio", 0.0),
                        levels=getattr(compressor, "levels", 0))
    assert sent[1][0] == expect and second.shape == x.shape


@pytest.mark.usefixtures("standalone_engine")
@pytest.mark.parametrize("make", [lambda: Compression.onebit(), lambda: Compression.topk(0.1),
                                  lambda: Compression.topk(0.1, momentum=0.9),
                                  lambda: Compression.randomk(0.1),
                                  lambda: Compression.powersgd(2)],
                         ids=["onebit", "topk", "topk-momentum", "randomk", "powersgd"])
def test_an_overflowed_step_leaves_the_state_as_it_was(make):
    # A loss-scaled fp16 step that overflowed is skipped; its inf must not stay.
    compressor, x = make(), tf.constant(_data(400).reshape(20, 20))
    compressor.reduce([x], ["g"])
    before = compressor.get_state()
    compressor.reduce([tf.tensor_scatter_nd_update(x, [[0, 0]], [np.inf])], ["g"])
    after = compressor.get_state()
    for key in before:
        if not key.startswith("step/"):
            np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    assert np.isfinite(compressor.reduce([x], ["g"])[0].numpy()).all()


@pytest.mark.usefixtures("standalone_engine")
def test_randomk_and_powersgd_follow_the_shared_seeds():
    randomk = Compression.randomk(0.1, seed=7)
    x = tf.constant(_data(200))
    for step in range(2):
        out = randomk.reduce([x], ["r"])[0].numpy()
        idx = _codec.randomk_indices(200, 20, 7, "r", step)
        assert sorted(np.flatnonzero(out != 0)) == sorted(i for i in idx if x.numpy()[i] != 0)
    assert randomk.get_state()["step/r"] == 2

    powersgd = Compression.powersgd(2, error_feedback=False)
    m = tf.constant(_data(120).reshape(12, 10))
    q0 = powersgd_initial_q(10, 2, 0, "w")  # the torch adapter's first Q as well
    out = powersgd.reduce([m, tf.ones(12)], ["w", "b"])
    p, _ = np.linalg.qr(m.numpy() @ q0)
    np.testing.assert_allclose(out[0].numpy(), p @ (m.numpy().T @ p).T, atol=1e-4)
    np.testing.assert_array_equal(out[1].numpy(), np.ones(12))  # 1-D: plain
    assert sorted(powersgd.get_state()) == ["q/w"]


@pytest.mark.usefixtures("standalone_engine")
def test_top_k_with_momentum_correction_follows_dgc():
    m, n, k = 0.9, 200, 20
    grads = [_data(n, seed=s) for s in range(4)]
    want, u, v = dgc_steps(grads, m, top(k))
    comp = Compression.topk(k / n, momentum=m)
    assert str(comp.spec).endswith("momentum=0.9")
    for s, g in enumerate(grads):
        np.testing.assert_allclose(comp.reduce([tf.constant(g)], ["g"])[0].numpy(), want[s],
                                   rtol=1e-5, atol=1e-6)
    state = comp.get_state()
    np.testing.assert_allclose(state["velocity/g"], u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["residual/g"], v, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="needs error_feedback on"):
        Compression.topk(0.1, momentum=0.9, error_feedback=False)


@pytest.mark.usefixtures("standalone_engine")
@pytest.mark.parametrize("make", [
    lambda: Compression.topk(0.1), lambda: Compression.topk(0.1, momentum=0.9), lambda: Compression.onebit(),
    lambda: Compression.dithering(4, stochastic=False), lambda: Compression.randomk(0.1),
    lambda: Compression.powersgd(2), lambda: Compression.policy("topk:0.1", min_size=50)],
    ids=["topk", "topk-momentum", "onebit", "dithering", "randomk", "powersgd", "policy"])
def test_graph_mode_equals_eager_mode_and_carries_the_state(make):
    x, b = tf.constant(_data(300).reshape(10, 30)), tf.constant(_data(10))
    eager, graph = make(), make()
    step = tf.function(lambda t, u: graph.reduce([t, u], ["g", "b"]))
    for _ in range(3):
        for want, got in zip(eager.reduce([x, b], ["g", "b"]), step(x, b)):
            np.testing.assert_allclose(want.numpy(), got.numpy(), rtol=1e-6, atol=1e-6)
    want, got = eager.get_state(), graph.get_state()
    assert sorted(want) == sorted(got) and want
    for key in want:
        np.testing.assert_allclose(want[key], got[key], rtol=1e-6, atol=1e-6)


@pytest.mark.usefixtures("standalone_engine")
def test_state_saves_and_restores_with_get_state_and_tf_checkpoints(tmp_path):
    x = tf.constant(_data(400).reshape(20, 20))
    for make in (lambda: Compression.onebit(), lambda: Compression.randomk(0.1),
                 lambda: Compression.powersgd(2),
                 lambda: Compression.policy("topk:0.1", [("w*", "onebit")], min_size=0)):
        original, copy, restored, deferred = make(), make(), make(), make()
        for _ in range(2):
            original.reduce([x, x], ["w", "v"])
        copy.set_state(original.get_state())  # before its first step: kept until then
        path = tf.train.Checkpoint(c=original).save(str(tmp_path / "ckpt"))
        restored.reduce([x, x], ["w", "v"])  # create the variables, then overwrite them
        tf.train.Checkpoint(c=restored).restore(path)
        tf.train.Checkpoint(c=deferred).restore(path)  # applied as its variables appear
        want = original.reduce([x, x], ["w", "v"])
        for other in (copy, restored, deferred):
            got = other.reduce([x, x], ["w", "v"])
            for a, b in zip(want, got):
                np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.usefixtures("standalone_engine")
def test_specs_policies_and_auto():
    assert from_spec("fp16") is Compression.fp16 and from_spec("none") is Compression.none
    assert from_spec("topk:0.01").ratio == 0.01 and from_spec("powersgd:3").rank == 3
    assert from_spec("onebit:scaled=false").scaling is False
    assert from_spec("dithering:16:error_feedback=false").error_feedback is False
    with pytest.raises(ValueError, match="topk needs a ratio"):
        from_spec("topk:0")
    policy = Compression.policy("topk:0.5", [{"pattern": "*bias", "compression": "fp16"}],
                                min_size=10)
    assert isinstance(policy, PolicyCompressor)
    out = policy.reduce([tf.ones(20), tf.ones(5), tf.ones([4, 5])], ["a/bias", "tiny", "k"])
    assert [o.shape for o in out] == [(20,), (5,), (4, 5)]
    assert sorted(policy.get_state()) == ["topk:ratio=0.5|residual/k"]

    auto = Compression.auto("topk:0.1", steps=2, bandwidth=1e3)  # a slow link: compress
    x = tf.constant(_data(4096))
    for _ in range(4):
        auto.reduce([x], ["big"])
    assert auto.policy.decision("big") is True
    with pytest.raises(RuntimeError, match="runs eagerly only"):
        tf.function(lambda t: auto.reduce([t], ["big"])[0])(x)
    check_compression(auto)
    with pytest.raises(ValueError, match="Received: compression=3"):
        check_compression(3)


@pytest.mark.usefixtures("standalone_engine")
def test_push_pull_and_the_optimizers_take_every_kind():
    import bpstrain.tensorflow as bps

    x = tf.constant(_data(64).reshape(8, 8))
    for compression in (Compression.bf16, "bf16", Compression.dithering(3)):
        assert bps.push_pull(x, name="pp", compression=compression).shape == (8, 8)
    # As torch's push_pull: a stateful spec string would make a compressor per call.
    with pytest.raises(ValueError, match="make it once"):
        bps.push_pull(x, name="pp", compression="onebit")

    # The optimizers apply a single codec to tensors of >= 1024 elements, as torch's.
    big, small = tf.Variable(tf.ones([40, 40])), tf.Variable(tf.ones([8, 8]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(big * _data(1600).reshape(40, 40)) + tf.reduce_sum(small * x)
    topk = Compression.topk(0.01)
    grads = bps.DistributedGradientTape(tape, compression=topk, name="tape").gradient(
        loss, [big, small])
    assert int(tf.math.count_nonzero(grads[0])) <= 16
    np.testing.assert_array_equal(grads[1].numpy(), x.numpy())  # small: plain
    assert list(topk.get_state()) == ["residual/tape.Variable"]  # the object we hold
    tape_spec = bps.DistributedGradientTape(tf.GradientTape(), compression="topk:0.01")
    assert isinstance(tape_spec._bps_compression, PolicyCompressor)


# -- the 2- and 3-worker jobs -------------------------------------------------------------

CHECKS = ["onebit", "onebit_unscaled", "topk", "dithering", "overflow", "randomk", "powersgd",
          "graph_mode", "server_state", "keras_onebit_fit"]
_jobs = {}


def job(workers):
    if workers not in _jobs:
        _jobs[workers] = launch([sys.executable, HERE / "tf_compression_worker.py"], workers,
                                {"KERAS_BACKEND": "tensorflow"}, timeout=240)
    return _jobs[workers]


needs_codec = pytest.mark.skipif(
    "compressed" not in engine.DTYPES,
    reason="the servers' codec (engine dtype 'compressed') is not built")


@needs_codec
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("name", CHECKS)
def test_check_on_several_workers(name, workers):
    assert_check(job(workers), name, workers)


@needs_codec
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [2, 3])
def test_job_exits_cleanly_and_runs_every_check(workers):
    code, out, results = job(workers)
    assert code == 0, out[-4000:]
    assert sorted(results) == sorted(CHECKS), out[-4000:]


@pytest.mark.usefixtures("standalone_engine")
def test_a_keras_checkpoint_carries_the_residuals_and_resumes_exactly(tmp_path):
    import keras

    import bpstrain.tensorflow.keras as bps_keras

    x = np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
        # Named: the state is keyed by engine names (a new process numbers alike).
        optimizer = bps_keras.DistributedOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), name="opt",
            compression=Compression.policy("onebit", min_size=0))  # tiny tensors too
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model, optimizer

    model, optimizer = build()
    model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    # The residuals are tracked by the optimizer: a plain tf.train.Checkpoint saves them.
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "c"))
    saved = [name for name, _ in tf.train.list_variables(path) if "residual" in name]
    assert len(saved) == 4, saved
    model.train_on_batch(x[:16], y[:16])

    resumed, resumed_optimizer = build()
    tf.train.Checkpoint(model=resumed, optimizer=resumed_optimizer).restore(path)
    resumed.train_on_batch(x[:16], y[:16])  # residuals restored as they are created
    for a, b in zip(model.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
