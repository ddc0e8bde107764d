"""Hook dispatch: both styles, order, signature detection, built-in callbacks as units."""

import math
import types

import pytest

from bpstrain.trainer import CSVLogger, Callback, EarlyStopping, Trainer
from bpstrain.trainer._dispatch import _style, fire, ordered
from bpstrain.trainer.callbacks import LearningRateSchedule, lr_factor
from tests.trainer.helpers import KerasBatchEnd, Recorder, base_config, blobs, tiny_net


@pytest.mark.timeout(60)
def test_hooks_of_both_styles_fire_in_order_during_fit(tmp_path):
    rec, keras_style = Recorder(), KerasBatchEnd()
    x, y = blobs(128)
    Trainer(base_config(tmp_path, **{"trainer.epochs": 2}), callbacks=[rec, keras_style]).fit(
        tiny_net(), (x, y), val_data=(x[:64], y[:64]))
    assert rec.calls == [
        "on_fit_start", "on_train_begin",
        "on_train_epoch_start", "on_epoch_begin:0", "on_train_batch_end:['accuracy', 'loss']",
        "on_validation_end", "on_train_epoch_end", "on_epoch_end:0:True",
        "on_train_epoch_start", "on_epoch_begin:1", "on_train_batch_end:['accuracy', 'loss']",
        "on_validation_end", "on_train_epoch_end", "on_epoch_end:1:True",
        "on_train_end", "on_fit_end"]
    assert keras_style.batches[0] == (0, ["accuracy", "batch", "loss", "size"])
    assert len(keras_style.batches) == 2 * 4  # 128 samples / 32 per batch, 2 epochs


@pytest.mark.timeout(10)
def test_shared_hook_names_are_told_apart_by_signature():
    class L(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx): ...
        def on_train_end(self, trainer, module): ...

    class K(Callback):
        def on_train_batch_end(self, batch, logs=None): ...
        def on_train_end(self, logs=None): ...

    assert _style(L, "on_train_batch_end") == _style(L, "on_train_end") == "lightning"
    assert _style(K, "on_train_batch_end") == _style(K, "on_train_end") == "keras"
    assert _style(Callback, "on_train_batch_end") is None  # not overridden: never called


@pytest.mark.timeout(10)
def test_fire_rejects_unknown_events_and_non_callbacks():
    with pytest.raises(ValueError, match="Received: event='on_fit_start'"):
        fire([], "on_fit_start")
    with pytest.raises(TypeError, match="Received: function"):
        ordered([lambda: None])


@pytest.mark.timeout(10)
def test_exception_hooks_never_mask_the_error():
    class Bad(Callback):
        def on_exception(self, trainer, module, exception):
            raise RuntimeError("cleanup failed")

    fire([Bad()], "exception", None, None, exception=ValueError("x"))  # does not raise


def _fake_trainer(**kw):
    base = dict(logs={}, current_epoch=0, is_global_zero=True, should_stop=False,
                resumed=False, print=lambda *_: None)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.timeout(10)
def test_early_stopping_counts_patience_and_keeps_state():
    stopper = EarlyStopping("val_loss", patience=2)
    trainer = _fake_trainer()
    stopper.on_fit_start(trainer, None)
    for epoch, loss in enumerate([1.0, 0.5, 0.6, 0.7]):
        trainer.current_epoch, trainer.logs = epoch, {"val_loss": loss}
        stopper.on_train_epoch_end(trainer, None)
    assert trainer.should_stop and stopper.stopped_epoch == 3 and stopper.best == 0.5
    restored = EarlyStopping("val_loss", patience=2)
    restored.load_state_dict(stopper.state_dict())
    assert (restored.best, restored.wait) == (0.5, 2)
    with pytest.warns(UserWarning, match="not in the epoch logs"):
        EarlyStopping("val_f1", patience=1).on_train_epoch_end(_fake_trainer(), None)


@pytest.mark.timeout(60)
def test_early_stopping_stops_a_fit(tmp_path):
    class WorseningMetric(Callback):
        def on_train_epoch_end(self, trainer, module):
            trainer.logs["fake"] = float(trainer.current_epoch)  # gets worse every epoch

    x, y = blobs(64)
    trainer = Trainer(base_config(tmp_path, **{"trainer.epochs": 10}),
                      callbacks=[WorseningMetric(), EarlyStopping("fake", patience=2, mode="min")])
    history = trainer.fit(tiny_net(), (x, y))
    assert len(history) == 3 and trainer.should_stop


@pytest.mark.timeout(60)
def test_csv_logger_writes_one_row_per_epoch_with_late_columns(tmp_path):
    x, y = blobs(64)
    cfg = base_config(tmp_path, **{"trainer.epochs": 3, "trainer.val_every": 2})
    trainer = Trainer(cfg)
    trainer.fit(tiny_net(), (x, y), val_data=(x, y))
    lines = (trainer.run_dir / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    assert header[:3] == ["epoch", "loss", "accuracy"] and "val_loss" in header
    assert len(lines) == 4
    rows = [dict(zip(header, line.split(","))) for line in lines[1:]]
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]
    assert rows[0]["val_loss"] == "" and rows[1]["val_loss"] != ""
    logger = CSVLogger(tmp_path / "x.csv")
    logger.load_state_dict({"rows": [{"epoch": 0, "loss": 1.0}]})
    assert logger.state_dict()["rows"] == [{"epoch": 0, "loss": 1.0}]


@pytest.mark.timeout(10)
def test_lr_factor_warmup_and_schedules():
    assert lr_factor(0.5, 10, warmup_epochs=1) == 0.5
    assert lr_factor(0.5, 10, warmup_epochs=1, warmup_start=0.5) == 0.75
    assert lr_factor(5, 10) == 1.0
    assert math.isclose(lr_factor(5, 10, schedule="cosine"), 0.5)
    assert math.isclose(lr_factor(7, 10, schedule="step", step_epochs=[3, 6], gamma=0.1), 0.01)
    with pytest.raises(ValueError, match="Received: schedule='linear'"):
        LearningRateSchedule(schedule="linear")


@pytest.mark.timeout(60)
def test_lr_warmup_callback_drives_the_optimizer(tmp_path):
    x, y = blobs(128)
    cfg = base_config(tmp_path, **{"trainer.epochs": 3, "optimizer.warmup_epochs": 2,
                                   "optimizer.schedule": "cosine"})
    history = Trainer(cfg).fit(tiny_net(), (x, y))
    lrs = history["lr"]
    assert lrs[0] == pytest.approx(0.005)   # halfway through the 2-epoch warm-up
    assert lrs[1] == pytest.approx(0.01)    # warm-up done
    assert lrs[2] == pytest.approx(0.0, abs=1e-9)  # cosine reaches 0 at the last step
