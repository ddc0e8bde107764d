"""The Keras branch of fit (in this process): BytePSCallback + the same callbacks."""

import pytest

from tests.trainer.helpers import base_config, blobs

keras = pytest.importorskip("keras")


@pytest.mark.timeout(120)
def test_keras_model_fits_with_trainer_callbacks(tmp_path):
    from bpstrain.trainer import Callback, Trainer

    class Batches(Callback):
        def __init__(self):
            self.count = 0

        def on_train_batch_end(self, batch, logs=None):
            self.count += 1

    keras.utils.set_random_seed(0)  # unseeded init made the accuracy check flaky (0.77 once)
    x, y = blobs(256)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    batches = Batches()
    cfg = base_config(tmp_path, **{"trainer.epochs": 3, "optimizer.warmup_epochs": 1})
    trainer = Trainer(cfg, callbacks=[batches])
    history = trainer.fit(model, (x, y), val_data=(x, y))
    assert len(history) == 3 and batches.count == 3 * 8
    assert history.last["val_accuracy"] > 0.9
    assert history["lr"][0] == pytest.approx(0.01)  # warm-up ends with epoch 0
    assert history.last["samples_per_s"] > 0
    assert (trainer.run_dir / "metrics.csv").read_text().count("\n") == 4


@pytest.mark.timeout(60)
def test_uncompiled_keras_model_is_compiled_from_config(tmp_path):
    from bpstrain.trainer import Trainer

    x, y = blobs(128)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    history = Trainer(base_config(tmp_path, **{"trainer.epochs": 2})).fit(model, (x, y))
    assert "accuracy" in history.last and model.compiled
    with pytest.raises(TypeError, match="Received: str"):
        Trainer(base_config(tmp_path)).fit(model, "x")


def _dropout_model(seed: int = 0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.3), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


@pytest.mark.timeout(120)
def test_keras_model_resumes_from_an_epoch_checkpoint_as_if_never_stopped(tmp_path):
    import numpy as np

    from bpstrain.trainer import Trainer

    x, y = blobs(128)
    cfg = {"trainer.epochs": 3, "trainer.batch_size": 16, "trainer.checkpoint_every": 1}
    whole = _dropout_model()
    Trainer(base_config(tmp_path / "whole", **cfg)).fit(whole, (x, y))

    first = _dropout_model()
    Trainer(base_config(tmp_path / "run", **{**cfg, "trainer.epochs": 2})).fit(first, (x, y))
    resumed = _dropout_model(seed=1)  # other initial weights and seeds: all come back
    trainer = Trainer(base_config(tmp_path / "run", **cfg, **{"trainer.resume": "auto"}))
    history = trainer.fit(resumed, (x, y))
    assert trainer.resumed and [e["epoch"] for e in history.to_dict()["epochs"]] == [0, 1, 2]
    assert int(resumed.optimizer.iterations.numpy()) == 3 * 8
    for a, b in zip(whole.variables, resumed.variables):  # weights and dropout seeds
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.timeout(120)
def test_keras_resume_from_a_torch_checkpoint_is_a_clear_error(tmp_path):
    from bpstrain.config import ConfigError
    from bpstrain.trainer import Trainer
    from tests.trainer.helpers import tiny_net

    x, y = blobs(64)
    cfg = {"trainer.epochs": 1, "trainer.batch_size": 16, "trainer.checkpoint_every": 1}
    Trainer(base_config(tmp_path, **cfg)).fit(tiny_net(), (x, y))
    with pytest.raises(ConfigError) as err:
        Trainer(base_config(tmp_path, **{**cfg, "trainer.resume": "auto", "trainer.epochs": 2})
                ).fit(_dropout_model(), (x, y))
    assert "holds no Keras model state" in str(err.value)
