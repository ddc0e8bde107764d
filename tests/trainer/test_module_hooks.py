"""Hooks defined on the torch module itself (LightningModule style): called with
Lightning's arguments, after the callbacks' hooks, and before the metric-monitoring
callbacks at on_train_epoch_end."""

import pytest
import torch

from bpstrain.trainer import Callback, ModelCheckpoint, Trainer
from bpstrain.trainer.callbacks import read_checkpoint
from tests.trainer.helpers import StepModule, base_config, blobs

FIT_HOOKS = ("fit_start", "train_start", "train_epoch_start", "train_batch_start",
             "after_backward", "before_optimizer_step", "train_batch_end", "validation_start",
             "validation_epoch_start", "validation_batch_end", "validation_epoch_end",
             "validation_end", "train_epoch_end", "train_end", "fit_end")
EVAL_HOOKS = ("test_start", "test_epoch_start", "test_batch_end", "test_epoch_end",
              "test_end", "predict_start", "predict_end")


def _recorder(prefix, events, with_trainer):
    """Methods ``on_<hook>`` that append ``prefix:<hook>`` to ``events``."""
    def make(name):
        if with_trainer:
            def hook(self, trainer, module, *args):
                assert isinstance(module, torch.nn.Module)
                events.append(f"{prefix}:{name}")
        else:
            def hook(self, *args):
                events.append(f"{prefix}:{name}")
        return hook
    return {f"on_{name}": make(name) for name in FIT_HOOKS + EVAL_HOOKS}


def _pair(events):
    """A callback and a module class recording into ``events``."""
    cb = type("Rec", (Callback,), _recorder("cb", events, True))()
    module_cls = type("HookedModule", (StepModule,), _recorder("mod", events, False))
    return cb, module_cls


@pytest.mark.timeout(60)
def test_module_hooks_run_after_the_callbacks_in_lightnings_order(tmp_path):
    events = []
    cb, module_cls = _pair(events)
    x, y = blobs(64)
    trainer = Trainer(base_config(tmp_path, **{"trainer.epochs": 1}), callbacks=[cb])
    trainer.fit(module_cls(), (x, y), val_data=(x[:32], y[:32]))
    expected = []
    for hook in ("fit_start", "train_start", "train_epoch_start"):
        expected += [f"cb:{hook}", f"mod:{hook}"]
    for _ in range(2):  # two training batches, one optimizer step each
        for hook in ("train_batch_start", "after_backward", "before_optimizer_step",
                     "train_batch_end"):
            expected += [f"cb:{hook}", f"mod:{hook}"]
    for hook in ("validation_start", "validation_epoch_start", "validation_batch_end",
                 "validation_epoch_end", "validation_end", "train_epoch_end", "train_end",
                 "fit_end"):
        expected += [f"cb:{hook}", f"mod:{hook}"]
    assert events == expected

    class TestBatches(Callback):
        def on_test_batch_end(self, trainer, module, outputs, batch, batch_idx):
            events.append(f"batch:{sorted(outputs)}:{batch_idx}")

    events.clear()
    model = module_cls()
    Trainer(base_config(tmp_path), callbacks=[TestBatches()]).test(model, (x[:16], y[:16]))
    assert [e for e in events if e.startswith("batch:")] == ["batch:['acc', 'loss']:0"]
    events.clear()
    trainer.test(model, (x, y))
    trainer.predict(model, x)
    assert events == [f"{who}:{hook}" for hook in ("test_start", "test_epoch_start",
                                                   "test_batch_end", "test_batch_end",
                                                   "test_epoch_end", "test_end",
                                                   "predict_start", "predict_end")
                      for who in ("cb", "mod")]


class Monitored(StepModule):
    """Puts a metric into the epoch logs from its own on_train_epoch_end."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_before_optimizer_step(self, optimizer):
        self.seen.append(("optimizer", isinstance(optimizer, torch.optim.Optimizer)))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append(("batch_end", sorted(outputs), batch_idx))

    def on_train_epoch_end(self):
        self.logs["custom"] = {0: 3.0, 1: 1.0, 2: 2.0}.get(self.epoch, 5.0)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["module_note"] = "saved by the module"

    def on_load_checkpoint(self, checkpoint):
        self.loaded_note = checkpoint["module_note"]
        self.loaded_before_weights = not torch.equal(
            checkpoint["model"]["net.0.weight"], self.net[0].weight)


class GiveLogs(Callback):
    """Gives the module the epoch logs (a module hook has no trainer argument)."""

    def on_train_epoch_start(self, trainer, module):
        module.logs, module.epoch = trainer.logs, trainer.current_epoch


@pytest.mark.timeout(60)
def test_monitoring_callbacks_see_what_the_modules_epoch_end_hook_logged(tmp_path):
    x, y = blobs(64)
    model = Monitored()
    cfg = base_config(tmp_path, **{"trainer.epochs": 3, "trainer.save_top_k": 1,
                                   "trainer.monitor": "custom", "trainer.monitor_mode": "min",
                                   "trainer.early_stopping_patience": 1})
    trainer = Trainer(cfg, callbacks=[GiveLogs()])
    history = trainer.fit(model, (x, y))
    assert history["custom"] == [3.0, 1.0, 2.0]
    saver = trainer.callback(ModelCheckpoint)
    assert saver.best_model_score == 1.0 and "custom=1.0000" in saver.best_model_path
    assert model.seen[:2] == [("optimizer", True), ("batch_end", ["acc", "loss"], 0)]
    ckpt = read_checkpoint(saver.best_model_path)
    assert ckpt["module_note"] == "saved by the module"

    resumed_model = Monitored()
    resumed = Trainer({**cfg, "trainer.epochs": 4, "trainer.resume": "auto"},
                      callbacks=[GiveLogs()])
    assert resumed.fit(resumed_model, (x, y))["custom"] == [3.0, 1.0, 2.0, 5.0]
    assert resumed_model.loaded_note == "saved by the module"
    assert resumed_model.loaded_before_weights  # Lightning's order: hook, then weights


@pytest.mark.timeout(30)
def test_returning_minus_one_from_on_train_batch_start_is_refused(tmp_path):
    class Skipper(StepModule):
        def on_train_batch_start(self, batch, batch_idx):
            return -1

    x, y = blobs(64)
    with pytest.raises(ValueError, match="every rank must run the same steps"):
        Trainer(base_config(tmp_path)).fit(Skipper(), (x, y))
