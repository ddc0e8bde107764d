"""trainer.precision, gradient clipping, validate/test/predict for Keras models (in this
process; tests/trainer/test_launched.py runs them as ranks of a launched job)."""

import numpy as np
import pytest

from tests.trainer.helpers import base_config, blobs

keras = pytest.importorskip("keras")


def _model(compile_with=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4)])
    if compile_with is not None:
        model.compile(optimizer=compile_with,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


def _probe():
    from bpstrain.trainer import Callback

    class Probe(Callback):
        """Records the layers' compute dtype and the optimizer while training."""

        def on_train_epoch_end(self, trainer, module):
            self.dtypes = {layer.compute_dtype for layer in module.layers}
            self.optimizer = module.optimizer

    return Probe()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision,dtype", [("bf16", "bfloat16"), ("16", "float16")])
def test_precision_sets_a_mixed_policy_while_training(tmp_path, precision, dtype):
    from bpstrain.trainer import Trainer

    x, y = blobs(256)
    model, probe = _model(keras.optimizers.Adam(0.01)), _probe()
    trainer = Trainer(base_config(tmp_path, **{"trainer.epochs": 3,
                                               "trainer.precision": precision}),
                      callbacks=[probe])
    history = trainer.fit(model, (x, y), val_data=(x, y))
    assert probe.dtypes == {dtype}
    assert history.last["val_accuracy"] > 0.9
    # Loss scaling only for float16, as torch's GradScaler.
    scaled = isinstance(probe.optimizer, keras.optimizers.LossScaleOptimizer)
    assert scaled == (precision == "16")
    # Variables stay float32, and afterwards the model computes in float32 again.
    assert {v.dtype for v in model.weights} == {"float32"}
    assert {layer.compute_dtype for layer in model.layers} == {"float32"}
    assert model.predict(x[:4], verbose=0).dtype == np.float32


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm,key", [("norm", "global_clipnorm"), ("value", "clipvalue")])
def test_gradient_clip_val_becomes_the_optimizers_clipping(tmp_path, algorithm, key):
    from bpstrain.trainer import Trainer

    x, y = blobs(64)
    model = _model(keras.optimizers.SGD(1.0))
    before = [w.copy() for w in model.get_weights()]
    cfg = base_config(tmp_path, **{"trainer.epochs": 1, "trainer.gradient_clip_val": 1e-3,
                                   "trainer.gradient_clip_algorithm": algorithm})
    Trainer(cfg).fit(model, (x, y))
    assert model.optimizer.get_config()[key] == 1e-3
    # Two SGD steps at lr 1 with gradients clipped to 1e-3 (norm: all together).
    moved = [np.abs(a - b) for a, b in zip(model.get_weights(), before)]
    if algorithm == "value":
        assert max(float(m.max()) for m in moved) <= 2e-3 * (1 + 1e-5)
    else:
        per_step = np.sqrt(sum(float((m ** 2).sum()) for m in moved))
        assert 0 < per_step <= 2e-3 * (1 + 1e-5)
    Trainer(cfg).fit(model, (x, y))  # a second fit of the same model is fine


@pytest.mark.timeout(60)
def test_clipping_twice_is_a_config_error(tmp_path):
    from bpstrain.config import ConfigError
    from bpstrain.trainer import Trainer

    x, y = blobs(64)
    model = _model(keras.optimizers.SGD(0.1, clipnorm=1.0))
    with pytest.raises(ConfigError, match="clips already"):
        Trainer(base_config(tmp_path, **{"trainer.gradient_clip_val": 0.5})).fit(model, (x, y))


@pytest.mark.timeout(120)
def test_validate_test_and_predict_match_keras_own(tmp_path):
    from bpstrain.trainer import Trainer

    x, y = blobs(200)
    model = _model(keras.optimizers.Adam(0.01))
    trainer = Trainer(base_config(tmp_path, **{"trainer.epochs": 2}))
    trainer.fit(model, (x, y))
    own = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    validated = trainer.validate(model, (x, y))
    assert validated == pytest.approx({"val_" + k: v for k, v in own.items()}, rel=1e-6)
    tested = trainer.test(model, lambda: (x, y))
    assert tested == pytest.approx({"test_" + k: v for k, v in own.items()}, rel=1e-6)
    predicted = trainer.predict(model, x)
    assert predicted.shape == (200, 4)
    np.testing.assert_allclose(predicted, model.predict(x, verbose=0), rtol=1e-6)
    assert np.array_equal(trainer.predict(model, (x, y)), predicted)
    # Under trainer.precision the evaluation runs in that dtype too.
    half = Trainer(base_config(tmp_path, **{"trainer.precision": "bf16"}))
    assert half.predict(model, x).dtype.name == "bfloat16"
    assert half.validate(model, (x, y))["val_accuracy"] > 0.9


@pytest.mark.timeout(60)
def test_an_uncompiled_model_is_compiled_from_the_config_for_evaluation(tmp_path):
    from bpstrain.trainer import Trainer

    x, y = blobs(64)
    metrics = Trainer(base_config(tmp_path)).validate(_model(), (x, y))
    assert set(metrics) == {"val_loss", "val_accuracy"}


@pytest.mark.timeout(60)
def test_keras_fit_shows_a_validation_bar(tmp_path, monkeypatch):
    import bpstrain.trainer.callbacks.progress as progress
    from bpstrain.trainer import Trainer
    from tests.trainer.test_parity import FakeSink

    sink = FakeSink()
    monkeypatch.setattr(progress, "TqdmSink", lambda: sink)
    x, y = blobs(128)
    cfg = base_config(tmp_path, **{"trainer.progress": True, "trainer.epochs": 1,
                                   "trainer.batch_size": 16})
    Trainer(cfg).fit(_model(keras.optimizers.Adam(0.01)), (x, y), val_data=(x[:48], y[:48]))
    starts = [c for c in sink.calls if c[0] == "start"]
    assert starts == [("start", "train", 8, True, "epoch 1/1"),
                      ("start", "val", 3, False, "validation")]
    assert ("update", "val", 3) in sink.calls and ("close", "val") in sink.calls
