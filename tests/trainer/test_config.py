"""Trainer accepts every config form; where fit runs is decided from config and env."""

import pytest
from omegaconf import OmegaConf

from bpstrain.config import Config, ConfigError, load_config, save_config
from bpstrain.trainer import (CSVLogger, CommTimeline, EarlyStopping, MetricAveraging,
                              ModelCheckpoint, ProgressBar, Throughput, Trainer, launch_mode)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("form", ["dataclass", "dictconfig", "nested", "dotted", "yaml", "none"])
def test_trainer_accepts_every_config_form(form, tmp_path):
    cfg = Config()
    cfg.trainer.epochs = 3
    variants = {
        "dataclass": lambda: cfg,
        "dictconfig": lambda: OmegaConf.structured(cfg),
        "nested": lambda: {"trainer": {"epochs": 3}},
        "dotted": lambda: {"trainer.epochs": 3},
        "yaml": lambda: str(save_config(cfg, tmp_path / "c.yaml")),
        "none": lambda: None,
    }
    trainer = Trainer(variants[form]())
    assert trainer.max_epochs == (1 if form == "none" else 3)
    assert OmegaConf.is_config(trainer.config)


@pytest.mark.timeout(30)
def test_bad_key_fails_at_construction():
    with pytest.raises(ConfigError, match="Did you mean 'trainer.epochs'"):
        Trainer({"trainer.epoch": 3})


@pytest.mark.timeout(30)
def test_launch_mode():
    one, two = load_config({"cluster.workers": 1}), load_config({"cluster.workers": 2})
    assert launch_mode(one, {}) == "in_process"
    assert launch_mode(two, {}) == "local_cluster"
    assert launch_mode(two, {"DMLC_ROLE": "worker"}) == "rank"
    with pytest.raises(ConfigError, match="Received: DMLC_ROLE=server"):
        launch_mode(two, {"DMLC_ROLE": "server"})


@pytest.mark.timeout(30)
def test_default_callbacks_follow_config_and_user_replaces_builtin():
    plain = Trainer({"trainer.progress": False})
    kinds = [type(cb) for cb in plain.callbacks]
    assert kinds[0] is MetricAveraging
    assert ProgressBar not in kinds and EarlyStopping not in kinds and ModelCheckpoint not in kinds
    assert Throughput in kinds and CSVLogger in kinds
    full = Trainer({"trainer.early_stopping_patience": 2, "trainer.checkpoint_every": 1,
                    "trainer.timeline": True}, callbacks=[EarlyStopping("val_accuracy", 5)])
    kinds = [type(cb) for cb in full.callbacks]
    assert kinds[-1] is ModelCheckpoint  # checkpoints run after everyone else
    assert CommTimeline in kinds and ProgressBar in kinds
    stoppers = [cb for cb in full.callbacks if isinstance(cb, EarlyStopping)]
    assert len(stoppers) == 1
    assert stoppers[0].monitor == "val_accuracy" and stoppers[0].mode == "max"
