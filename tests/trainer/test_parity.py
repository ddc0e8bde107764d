"""Lightning/Keras parity of the Trainer: precision, clipping and its hooks, schedulers
from configure_optimizers, validate/test/predict, best-k checkpoints, TensorBoard,
progress bars, run folders."""

import math

import pytest
import torch
from torch import nn

from bpstrain.config import ConfigError, load_config
from bpstrain.trainer import Callback, ModelCheckpoint, ProgressBar, Trainer
from bpstrain.trainer.callbacks import read_checkpoint
from tests.trainer.helpers import StepModule, base_config, blobs, tiny_net


class DtypeProbe(nn.Module):
    """tiny_net that records the dtype of its logits in training."""

    def __init__(self):
        super().__init__()
        self.net = tiny_net()
        self.dtypes = set()

    def forward(self, x):
        out = self.net(x)
        if self.training:
            self.dtypes.add(out.dtype)
        return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("precision,dtype", [("32", torch.float32), ("bf16", torch.bfloat16),
                                             ("16", torch.float16)])
def test_precision_autocasts_the_forward_pass_and_still_learns(tmp_path, precision, dtype):
    x, y = blobs(256)
    model = DtypeProbe()
    trainer = Trainer(base_config(tmp_path, **{"trainer.precision": precision,
                                               "trainer.epochs": 3}))
    history = trainer.fit(model, (x, y), val_data=(x, y))
    assert model.dtypes == {dtype}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights
    assert history.last["val_accuracy"] > 0.9
    assert (trainer.precision_plugin.scaler is not None) == (precision == "16")


class InfOnce(Callback):
    """Puts an inf into one gradient after the backward pass of batch ``at``."""

    def __init__(self, at=2):
        self.at, self.before, self.after, self.batch = at, None, None, -1

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batch = batch_idx

    def on_after_backward(self, trainer, module):
        if self.batch == self.at:
            next(module.parameters()).grad.view(-1)[0] = math.inf
            self.before = [p.detach().clone() for p in module.parameters()]
            self.scale = trainer.precision_plugin.scaler.get_scale()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == self.at:
            self.after = [p.detach().clone() for p in module.parameters()]
            self.scale_after = trainer.precision_plugin.scaler.get_scale()


@pytest.mark.timeout(60)
def test_fp16_grad_scaler_skips_a_step_with_inf_gradients_and_is_checkpointed(tmp_path):
    x, y = blobs(256)
    probe = InfOnce()
    trainer = Trainer(base_config(tmp_path, **{"trainer.precision": "16",
                                               "trainer.checkpoint_every": 1}),
                      callbacks=[probe])
    trainer.fit(tiny_net(), (x, y))
    assert all(torch.equal(a, b) for a, b in zip(probe.before, probe.after))  # step skipped
    assert probe.scale_after == probe.scale / 2
    ckpt = read_checkpoint(trainer.run_dir / "checkpoints" / "last.ckpt")
    assert ckpt["grad_scaler"]["scale"] == trainer.precision_plugin.scaler.get_scale()


class RecordingSGD(torch.optim.SGD):
    """SGD that records the total gradient norm it steps with."""

    norms: list

    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))))
        return super().step(closure)


class ClipModule(StepModule):
    def configure_optimizers(self):
        opt = RecordingSGD(self.parameters(), lr=0.1)
        opt.norms = []
        return opt


class HookOrder(Callback):
    def __init__(self):
        self.events, self.norms_seen = [], []

    def on_after_backward(self, trainer, module):
        self.events.append("after_backward")

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.events.append("before_optimizer_step")
        self.norms_seen.append(float(torch.nn.utils.get_total_norm(
            [p.grad for p in module.parameters()])))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.events.append("batch_end")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_and_its_hooks(tmp_path, algorithm):
    x, y = blobs(128)
    hooks, model = HookOrder(), ClipModule()
    cfg = base_config(tmp_path, **{"trainer.epochs": 1, "trainer.gradient_clip_val": 0.05,
                                   "trainer.gradient_clip_algorithm": algorithm,
                                   "optimizer.backward_passes_per_step": 2})
    trainer = Trainer(cfg, callbacks=[hooks])
    trainer.fit(model, (x, y))
    norms = trainer.optimizer.norms
    assert len(norms) == 2  # 4 batches, 2 backward passes per step
    # The hook sees the gradients before clipping; the optimizer steps with clipped ones.
    assert all(seen > 0.05 for seen in hooks.norms_seen)
    if algorithm == "norm":
        assert all(n <= 0.05 * (1 + 1e-4) for n in norms)
        assert float(trainer.last_grad_norm) == pytest.approx(hooks.norms_seen[-1], rel=1e-5)
    else:
        assert all(n < seen for n, seen in zip(norms, hooks.norms_seen))
    assert hooks.events[:6] == ["after_backward", "batch_end", "after_backward",
                                "before_optimizer_step", "batch_end", "after_backward"]


class ScheduledModule(StepModule):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.kind == "epoch":
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]
        if self.kind == "step":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.1, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "loss"}}


@pytest.mark.timeout(60)
def test_configure_optimizers_schedulers_step_per_epoch_per_step_and_on_plateau(tmp_path):
    x, y = blobs(128)
    with _no_scheduler_warning():
        history = Trainer(base_config(tmp_path, **{"trainer.epochs": 3})).fit(
            ScheduledModule("epoch"), (x, y))
    assert history["lr"] == pytest.approx([0.1, 0.05, 0.025])
    trainer = Trainer(base_config(tmp_path, **{"trainer.epochs": 2}))
    trainer.fit(ScheduledModule("step"), (x, y))  # 4 steps per epoch
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 9)
    assert trainer.history["lr"] == pytest.approx([0.1 / 5, 0.1 / 9])  # after each epoch

    class Worse(Callback):  # makes the monitored loss go up after epoch 0
        def on_train_epoch_end(self, trainer, module):
            trainer.logs["loss"] = 1.0 + trainer.current_epoch

    trainer = Trainer(base_config(tmp_path, **{"trainer.epochs": 3}), callbacks=[Worse()])
    history = trainer.fit(ScheduledModule("plateau"), (x, y))
    assert history["lr"] == pytest.approx([0.1, 0.1, 0.01])  # the rate each epoch used
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.001)


class _no_scheduler_warning:
    """Fails if torch warns that the scheduler stepped before the optimizer."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings(record=True)
        self.caught = self._ctx.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        assert not [w for w in self.caught if "lr_scheduler" in str(w.message)]


@pytest.mark.timeout(90)
def test_resumed_schedulers_continue_exactly(tmp_path):
    x, y = blobs(128)
    straight = Trainer(base_config(tmp_path / "a", **{"trainer.epochs": 4})).fit(
        ScheduledModule("epoch"), (x, y))
    cfg = base_config(tmp_path / "b", **{"trainer.epochs": 2, "trainer.checkpoint_every": 1})
    Trainer(cfg).fit(ScheduledModule("epoch"), (x, y))
    resumed = Trainer({**cfg, "trainer.epochs": 4, "trainer.resume": "auto"}).fit(
        ScheduledModule("epoch"), (x, y))
    assert resumed["lr"] == pytest.approx(straight["lr"]) == [0.1, 0.05, 0.025, 0.0125]


@pytest.mark.timeout(30)
def test_configure_optimizers_rejects_bad_forms(tmp_path):
    x, y = blobs(64)

    class Two(StepModule):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), 0.1), torch.optim.SGD(self.parameters(), 1)]

    with pytest.raises(TypeError, match="in two optimizers"):
        Trainer(base_config(tmp_path)).fit(Two(), (x, y))
    with pytest.raises(ConfigError, match="both would set the learning rate"):
        Trainer(base_config(tmp_path, **{"optimizer.warmup_epochs": 1})).fit(
            ScheduledModule("epoch"), (x, y))


class ModuleWithTestStep(StepModule):
    def test_step(self, batch, batch_idx):
        out = self.training_step(batch, batch_idx)
        return {"loss": out["loss"], "acc": out["acc"], "tested": torch.tensor(1.0)}

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(1)


@pytest.mark.timeout(60)
def test_validate_test_and_predict(tmp_path):
    x, y = blobs(200)
    model = tiny_net()
    trainer = Trainer(base_config(tmp_path, **{"trainer.batch_size": 16}))
    history = trainer.fit(model, (x, y), val_data=(x, y))
    metrics = trainer.validate(model, (x, y))
    assert set(metrics) == {"val_loss", "val_accuracy"}
    assert metrics["val_loss"] == pytest.approx(history.last["val_loss"], rel=1e-6)
    tested = trainer.test(model, (x, y))
    assert tested == pytest.approx({"test_loss": metrics["val_loss"],
                                    "test_accuracy": metrics["val_accuracy"]})
    predictions = trainer.predict(model, x)  # one array of inputs
    assert len(predictions) == math.ceil(200 / 16)
    with torch.no_grad():
        assert torch.allclose(torch.cat(predictions), model(torch.as_tensor(x)), atol=1e-6)

    custom = ModuleWithTestStep()
    result = Trainer(base_config(tmp_path)).test(custom, (x, y))
    assert set(result) == {"test_loss", "test_acc", "test_tested"} and result["test_tested"] == 1
    labels = torch.cat(Trainer(base_config(tmp_path)).predict(custom, (x, y)))
    assert labels.shape == (200,) and labels.dtype == torch.int64


@pytest.mark.timeout(60)
def test_best_k_checkpoints_keep_the_best_by_the_monitored_metric(tmp_path):
    x, y = blobs(256)

    class Scores(Callback):  # a known, non-monotonic val_loss sequence
        def on_validation_end(self, trainer, module):
            trainer.logs["val_loss"] = [0.5, 0.2, 0.4, 0.1, 0.3][trainer.current_epoch]

    trainer = Trainer(base_config(tmp_path, **{"trainer.epochs": 5, "trainer.save_top_k": 2}),
                      callbacks=[Scores()])
    trainer.fit(tiny_net(), (x, y), val_data=(x, y))
    folder = trainer.run_dir / "checkpoints"
    best = sorted(p.name for p in folder.glob("*-val_loss=*.ckpt"))
    assert best == ["epoch=0001-val_loss=0.2000.ckpt", "epoch=0003-val_loss=0.1000.ckpt"]
    saver = trainer.callback(ModelCheckpoint)
    assert saver.best_model_path.endswith("epoch=0003-val_loss=0.1000.ckpt")
    assert saver.best_model_score == 0.1
    assert read_checkpoint(saver.best_model_path)["epoch"] == 3
    assert (folder / "last.ckpt").is_file()  # resume still continues from the end

    maxed = Trainer(base_config(tmp_path, **{"trainer.epochs": 3, "trainer.save_top_k": 1,
                                             "trainer.monitor": "val_accuracy"}))
    history = maxed.fit(tiny_net(), (x, y), val_data=(x, y))
    score = maxed.callback(ModelCheckpoint).best_model_score
    assert score == max(history["val_accuracy"])


@pytest.mark.timeout(60)
def test_tensorboard_logger_writes_the_epoch_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = blobs(128)
    trainer = Trainer(base_config(tmp_path, **{"trainer.loggers": ["csv", "tensorboard"],
                                               "trainer.log_every": 1}))
    assert [type(cb).__name__ for cb in trainer.loggers] == ["CSVLogger", "TensorBoardLogger"]
    history = trainer.fit(tiny_net(), (x, y), val_data=(x, y))
    events = EventAccumulator(str(trainer.run_dir))
    events.Reload()
    loss = [e.value for e in events.Scalars("train/loss")]
    val = [e.value for e in events.Scalars("val/accuracy")]
    assert loss == pytest.approx(history["loss"]) and val == pytest.approx(history["val_accuracy"])
    assert [e.step for e in events.Scalars("train/loss")] == [4, 8]
    assert len(events.Scalars("train/loss_step")) == 8
    assert (trainer.run_dir / "metrics.csv").is_file()
    assert Trainer(base_config(tmp_path, **{"trainer.loggers": []})).loggers == []


class FakeSink:
    def __init__(self):
        self.calls = []

    def start(self, total, initial, desc, name="train", leave=True):
        self.calls.append(("start", name, total, leave, desc))

    def update(self, step, desc=None, postfix=None, name="train"):
        self.calls.append(("update", name, step))

    def write(self, line, stderr=False):
        self.calls.append(("write", line))

    def close(self, name=None):
        self.calls.append(("close", name))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("summary", [True, False])
def test_progress_bar_per_epoch_with_a_validation_bar(tmp_path, summary, monkeypatch):
    import bpstrain.trainer.callbacks.progress as progress

    sink = FakeSink()
    monkeypatch.setattr(progress, "TqdmSink", lambda: sink)
    x, y = blobs(128)
    cfg = base_config(tmp_path, **{"trainer.progress": True, "trainer.epoch_summary": summary,
                                   "trainer.val_steps": 3, "trainer.batch_size": 16})
    trainer = Trainer(cfg)
    assert trainer.callback(ProgressBar).print_metrics is summary
    trainer.fit(tiny_net(), (x, y), val_data=(x, y))
    starts = [c for c in sink.calls if c[0] == "start"]
    assert starts == [("start", "train", 8, True, "epoch 1/2"), ("start", "val", 3, False,
                                                                  "validation"),
                      ("start", "train", 8, True, "epoch 2/2"), ("start", "val", 3, False,
                                                                  "validation")]
    assert ("update", "val", 3) in sink.calls and ("close", "val") in sink.calls
    lines = [c[1] for c in sink.calls if c[0] == "write"]
    assert len(lines) == (2 if summary else 0)
    if summary:
        assert lines[0].startswith("epoch 1/2: loss=") and "val_loss=" in lines[0]


@pytest.mark.timeout(60)
def test_each_run_gets_a_folder_with_its_resolved_config(tmp_path):
    x, y = blobs(64)
    trainer = Trainer(base_config(tmp_path, **{"trainer.epochs": 1}))
    trainer.fit(tiny_net(), (x, y))
    first = (trainer.run_dir / "metrics.csv").read_text()
    trainer.fit(tiny_net(), (x, y))  # the same Trainer again: a new run folder
    again = Trainer(base_config(tmp_path, **{"trainer.epochs": 2}))
    again.fit(tiny_net(), (x, y))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["version_0", "version_1", "version_2"]
    assert (tmp_path / "version_0" / "metrics.csv").read_text() == first  # not overwritten
    assert len((tmp_path / "version_2" / "metrics.csv").read_text().splitlines()) == 3
    saved = load_config(str(tmp_path / "version_2" / "config.yaml"))
    assert saved.trainer.epochs == 2 and saved.trainer.run_name == "version_2"
    named = Trainer(base_config(tmp_path, **{"trainer.run_name": "baseline"}))
    named.fit(tiny_net(), (x, y))
    assert named.run_dir == tmp_path / "baseline" and (named.run_dir / "config.yaml").is_file()


@pytest.mark.timeout(30)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_device_cuda_without_cuda_is_a_config_error(tmp_path):
    x, y = blobs(64)
    trainer = Trainer(base_config(tmp_path, **{"trainer.device": "cuda",
                                               "cluster.workers": 2}))
    with pytest.raises(ConfigError, match="torch sees no CUDA device") as err:
        trainer.fit(tiny_net(), (x, y))  # before any worker process starts
    assert "\n" not in str(err.value)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.timeout(30)
def test_new_trainer_keys_are_validated():
    for key, value, hint in (("trainer.precision", "fp16", "'bf16'"),
                             ("trainer.gradient_clip_val", 0, "> 0 or null"),
                             ("trainer.loggers", ["tb"], "'csv', 'tensorboard'"),
                             ("trainer.monitor_mode", "maximum", "'max'"),
                             ("trainer.run_name", "a/b", "no '/'")):
        with pytest.raises(ConfigError, match=hint):
            load_config({key: value})
    assert load_config({"trainer.precision": 16}).trainer.precision == "16"  # YAML int
