"""load_config / save_config: input forms, overrides, struct mode and error messages."""

import pytest
from omegaconf import OmegaConf

from bpstrain.config import Config, ConfigError, TrainerConfig, load_config, save_config

pytestmark = pytest.mark.timeout(30)


# ------------------------------------------------------------------- input forms


def test_accepts_dataclass_dictconfig_nested_and_dotted_dicts():
    from_dc = load_config(Config(trainer=TrainerConfig(epochs=3)))
    from_dictconfig = load_config(OmegaConf.create({"trainer": {"epochs": 3}}))
    from_nested = load_config({"trainer": {"epochs": 3}})
    from_dotted = load_config({"trainer.epochs": 3})
    for cfg in (from_dc, from_dictconfig, from_nested, from_dotted):
        assert cfg.trainer.epochs == 3
        assert OmegaConf.is_struct(cfg)


def test_dotted_and_nested_keys_mix():
    cfg = load_config({"cluster": {"workers": 4}, "cluster.servers": 2})
    assert (cfg.cluster.workers, cfg.cluster.servers) == (4, 2)


def test_accepts_a_yaml_path(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  epochs: 5\ncomm:\n  numa: off\n")
    cfg = load_config(path)
    assert cfg.trainer.epochs == 5
    assert cfg.comm.numa == "off"  # unquoted YAML `off` is a bool; repaired for numa


def test_missing_yaml_path_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="Received: path="):
        load_config(tmp_path / "nope.yaml")


def test_rejects_other_types():
    with pytest.raises(ConfigError, match="Received: cfg=int"):
        load_config(3)


# ----------------------------------------------------------------------- overrides


def test_overrides_parse_yaml_values_and_apply_last():
    cfg = load_config({"trainer.epochs": 3}, ["trainer.epochs=7", "optimizer.lr=1e-3",
                                              "comm.priority=false", "trainer.steps=null"])
    assert cfg.trainer.epochs == 7
    assert cfg.optimizer.lr == pytest.approx(1e-3)
    assert cfg.comm.priority is False
    assert cfg.trainer.steps is None


def test_string_fields_keep_the_text_typed():
    cfg = load_config(overrides=["comm.numa=off", "cluster.secret=123", "trainer.out_dir=yes"])
    assert cfg.comm.numa == "off"
    assert cfg.cluster.secret == "123"
    assert cfg.trainer.out_dir == "yes"


def test_overrides_as_dict_and_model_kwargs():
    cfg = load_config({"model": {"name": "digits_mlp", "kwargs": {"hidden": 8}}},
                      {"model.kwargs.dropout": 0.1})
    assert dict(cfg.model.kwargs) == {"hidden": 8, "dropout": 0.1}


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(overrides=["trainer.epochs"])


def test_interpolations_are_kept_and_resolved():
    cfg = load_config({"model.kwargs.num_classes": "${data.num_classes}"},
                      ["data.num_classes=7"])
    assert cfg.model.kwargs.num_classes == 7


# -------------------------------------------------------------------------- errors


@pytest.mark.parametrize("key, suggestion", [
    ("trainer.epoch", "trainer.epochs"),
    ("trainer.batchsize", "trainer.batch_size"),
    ("epochs", "trainer.epochs"),
    ("comm.workers", "cluster.workers"),
    ("optimzer.lr", "optimizer"),
])
def test_unknown_key_names_it_and_suggests(key, suggestion):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{key}=1"])
    message = str(info.value)
    assert f"'{key}'" in message
    assert f"Did you mean '{suggestion}" in message
    assert message.endswith(f"Received: key={key}")


def test_unknown_key_in_a_dict_config():
    with pytest.raises(ConfigError, match=r"Received: key=cluster\.worker$"):
        load_config({"cluster": {"worker": 2}})


def test_struct_mode_rejects_new_keys_after_loading():
    cfg = load_config()
    with pytest.raises(Exception):
        cfg.trainer.epoch = 3
    cfg.trainer.epochs = 4  # known keys stay writable
    assert cfg.trainer.epochs == 4


@pytest.mark.parametrize("override, expected", [
    ("trainer.epochs=abc", "expects int"),
    ("trainer.epochs=1.5", "expects int"),
    ("comm.priority=maybe", "expects bool"),
    ("optimizer.lr=fast", "expects float"),
    ("trainer=3", "is a section"),
])
def test_type_errors_are_clear(override, expected):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert expected in str(info.value)
    assert f"Received: {key}=" in str(info.value)


def test_bool_for_a_string_key_in_yaml_asks_for_quotes():
    with pytest.raises(ConfigError, match="quote"):
        load_config({"trainer": {"out_dir": False}})


@pytest.mark.parametrize("override", [
    "trainer.epochs=0", "trainer.batch_size=-1", "trainer.steps=0", "trainer.loss=hinge",
    "optimizer.lr=0", "optimizer.name=adm", "optimizer.betas=[0.9]",
    "cluster.workers=0", "cluster.servers=0", "cluster.port=70000",
    "cluster.start_method=thread", "comm.partition_bytes=-1", "comm.numa=node:x",
    "comm.hierarchical=sometimes", "comm.timeout=0", "data.name=imagenet",
    "data.val_fraction=1.0",
])
def test_out_of_range_values(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"Received: {key}="):
        load_config(overrides=[override])


def test_local_size_must_divide_workers():
    load_config(overrides=["cluster.workers=4", "cluster.local_size=2"])
    with pytest.raises(ConfigError, match="divisor"):
        load_config(overrides=["cluster.workers=3", "cluster.local_size=2"])


@pytest.mark.parametrize("numa", ["auto", "off", "node:0", "cpus:0-3,8", "cpus:5"])
def test_numa_forms(numa):
    assert load_config(overrides=[f"comm.numa={numa}"]).comm.numa == numa


def test_choice_error_suggests():
    with pytest.raises(ConfigError, match="did you mean 'adam'"):
        load_config(overrides=["optimizer.name=adm"])


def test_bad_interpolation():
    with pytest.raises(ConfigError, match="trainer.epochs"):
        load_config({"trainer.epochs": "${comm.numa}"})


# ------------------------------------------------------------------------- save


def test_save_config_round_trips_resolved(tmp_path):
    cfg = load_config({"model.kwargs.num_classes": "${data.num_classes}"},
                      ["data.num_classes=7", "comm.numa=off", "cluster.secret=s3"])
    path = save_config(cfg, tmp_path / "sub" / "config.yaml")
    text = path.read_text()
    assert "${" not in text
    again = load_config(path)
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg, resolve=True)


def test_save_config_refuses_invalid(tmp_path):
    with pytest.raises(ConfigError):
        save_config({"trainer.epochs": 0}, tmp_path / "bad.yaml")
    assert not (tmp_path / "bad.yaml").exists()


def test_interpolation_in_an_override_refers_to_the_merged_config():
    cfg = load_config(overrides=["trainer.epochs=${cluster.workers}", "cluster.workers=3"])
    assert cfg.trainer.epochs == 3


def test_unresolvable_interpolation_names_the_key():
    with pytest.raises(ConfigError, match="trainer.epochs' has an interpolation"):
        load_config(overrides=["trainer.epochs=${nope}"])


def test_invalid_yaml_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(overrides=["optimizer.betas=[0.9,"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1,\n")
    with pytest.raises(ConfigError, match="Received: path="):
        load_config(bad)
