"""Checkpoints hold model, optimizer, counters, history and callback state; resume continues."""

import pytest
import torch

from bpstrain.trainer import ModelCheckpoint, Trainer, find_last_checkpoint
from bpstrain.trainer.callbacks import read_checkpoint
from tests.trainer.helpers import Recorder, base_config, blobs, tiny_net


@pytest.mark.timeout(90)
def test_resume_from_last_checkpoint_continues_training(tmp_path):
    x, y = blobs(128)
    first = Recorder()
    cfg = base_config(tmp_path, **{"trainer.epochs": 2, "trainer.checkpoint_every": 1})
    Trainer(cfg, callbacks=[first]).fit(tiny_net(), (x, y), val_data=(x, y))
    last = find_last_checkpoint(tmp_path)
    assert last == tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in last.parent.glob("epoch=*.ckpt")) == [
        "epoch=0000.ckpt", "epoch=0001.ckpt"]
    ckpt = read_checkpoint(last)
    assert ckpt["epoch"] == 1 and ckpt["global_step"] == 8
    assert ckpt["callbacks"]["Recorder"] == {"epochs_seen": 2}
    assert [e["epoch"] for e in ckpt["history"]["epochs"]] == [0, 1]
    assert ckpt["optimizer"]["state"]  # Adam moments were saved

    resumed = Recorder()
    model = tiny_net()
    trainer = Trainer({**cfg, "trainer.epochs": 4, "trainer.resume": "auto"}, callbacks=[resumed])
    history = trainer.fit(model, (x, y), val_data=(x, y))
    assert [e["epoch"] for e in history.epochs] == [0, 1, 2, 3]
    assert resumed.epochs_seen == 4  # 2 restored + 2 new
    assert resumed.calls.count("on_train_epoch_end") == 2
    assert trainer.global_step == 16
    assert history["val_accuracy"][-1] > 0.9
    assert trainer.run_dir == tmp_path / "version_0"  # resume=auto continues that run
    lines = (trainer.run_dir / "metrics.csv").read_text().splitlines()
    assert len(lines) == 5  # header + 4 epochs: the CSV continued


@pytest.mark.timeout(60)
def test_resume_auto_without_checkpoint_starts_fresh_and_bad_path_fails(tmp_path):
    x, y = blobs(64)
    history = Trainer(base_config(tmp_path, **{"trainer.resume": "auto"})).fit(tiny_net(), (x, y))
    assert len(history) == 2
    with pytest.raises(FileNotFoundError, match="Received: path="):
        Trainer(base_config(tmp_path, **{"trainer.resume": str(tmp_path / "nope.ckpt")})).fit(
            tiny_net(), (x, y))


@pytest.mark.timeout(60)
def test_checkpoint_keep_and_custom_dir(tmp_path):
    x, y = blobs(64)
    saver = ModelCheckpoint(tmp_path / "ck", every_n_epochs=1, keep=1)
    model = tiny_net()
    Trainer(base_config(tmp_path, **{"trainer.epochs": 3}), callbacks=[saver]).fit(model, (x, y))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["epoch=0002.ckpt", "last.ckpt"]
    state = read_checkpoint(tmp_path / "ck" / "last.ckpt")["model"]
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
