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
