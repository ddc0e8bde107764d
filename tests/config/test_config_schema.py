"""The schema: the keys the rest of bpstrain relies on exist with their contract defaults."""

import dataclasses

import pytest
from omegaconf import OmegaConf

from bpstrain.config import CommConfig, Config, ConfigError, load_config, to_comm_config

pytestmark = pytest.mark.timeout(30)


def test_comm_config_is_what_the_engine_reads():
    from bpstrain.engine import COMM_DEFAULTS

    fields = dataclasses.asdict(CommConfig())  # (compression_rules has a default factory)
    assert {**fields, "secret": ""} == COMM_DEFAULTS
    # 0 = auto: the engine sizes partitions from the link it measures.
    assert fields["partition_bytes"] == 0 and fields["priority"] is True
    assert fields["hierarchical"] == "auto"


@pytest.mark.parametrize("key", [
    "trainer.epochs", "trainer.batch_size", "trainer.steps", "trainer.seed",
    "trainer.log_every", "trainer.out_dir", "trainer.val_every", "trainer.val_steps",
    "data.name", "data.path", "data.synthetic", "model.name", "model.kwargs",
    "optimizer.name", "optimizer.lr", "cluster.workers", "cluster.servers",
    "cluster.local_size", "cluster.secret", "cluster.host", "cluster.port",
    "comm.partition_bytes", "comm.priority", "comm.numa",
])
def test_required_keys_exist(key):
    cfg = load_config()
    assert OmegaConf.select(cfg, key, default="<missing>") != "<missing>"


def test_defaults_load_and_validate():
    cfg = load_config()
    assert cfg.trainer.loss == "cross_entropy"
    assert cfg.trainer.steps is None
    assert cfg.cluster.workers == 1 and cfg.cluster.servers == 1
    assert isinstance(OmegaConf.to_object(cfg), Config)


def test_to_comm_config_returns_the_dataclass():
    comm = to_comm_config(load_config(overrides=["comm.partition_bytes=1024",
                                                 "comm.priority=false"]))
    assert isinstance(comm, CommConfig)
    assert comm.partition_bytes == 1024 and comm.priority is False
    assert comm.numa == "auto"


def test_to_comm_config_accepts_sections_and_none():
    assert to_comm_config() == CommConfig()
    assert to_comm_config({"numa": "node:1"}).numa == "node:1"
    assert to_comm_config(CommConfig(timeout=5.0)).timeout == 5.0
    assert to_comm_config(Config()) == CommConfig()
    cfg = load_config(overrides=["comm.engine_threads=4"])
    assert to_comm_config(cfg.comm).engine_threads == 4


def test_config_error_is_the_package_wide_class():
    import bpstrain.errors

    assert ConfigError is bpstrain.errors.ConfigError
    assert issubclass(ConfigError, ValueError)
