"""One config path: every comm constraint is written once (the schema's Knob) and the
environment reader, the config loader and engine.init apply it alike."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from bpstrain import engine
from bpstrain.config import CommConfig, ConfigError, comm_options, load_config, schema
from bpstrain.config.env import read_env

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def standalone(monkeypatch):
    for name in [n for n in os.environ if n.startswith(("DMLC_", "BYTEPS_", "BPSTRAIN_"))]:
        monkeypatch.delenv(name)
    engine.shutdown()
    yield
    engine.shutdown()


def test_every_comm_field_has_one_knob_with_doc_and_env():
    knobs = schema.comm_knobs()
    assert list(knobs) == [f.name for f in dataclasses.fields(CommConfig)]
    for key, (kind, knob) in knobs.items():
        assert knob.doc and knob.env and all(v.startswith(("BPSTRAIN_", "BYTEPS_")) for v in knob.env)
        assert isinstance(getattr(CommConfig(), key), kind), key


# The C++ engine checks the same bounds again (core_ext/src/worker.cc, server.cc).
BOUNDS = [  # key, environment variable, bad values, edge values that are fine
    ("connections_per_server", "BPSTRAIN_CONNECTIONS_PER_SERVER", [0, 65], [1, 64]),
    ("engine_threads", "BPSTRAIN_ENGINE_THREADS", [0, 257], [1, 256]),
    ("partition_bytes", "BPSTRAIN_PARTITION_BYTES", [-1], [0, 1, 7]),
    ("socket_send_buffer", "BPSTRAIN_SOCKET_SEND_BUFFER", [-2], [-1, 0, 4096]),
    ("credit_bytes", "BPSTRAIN_CREDIT_BYTES", [-1], [0, 1 << 20]),
    ("hierarchical", "BPSTRAIN_HIERARCHICAL", ["maybe"], ["auto", "true", "false"]),
    ("timeout", "BPSTRAIN_TIMEOUT", [0, -1.5], [0.5]),
    ("aggregate", "BPSTRAIN_AGGREGATE", ["k:0", "most", "k:x", "3"], ["all", "k:3"]),
    ("consistency", "BPSTRAIN_CONSISTENCY", ["ssp", "ssp:-1", "ssp:1001", "bsp"],
     ["sync", "ssp:0", "ssp:1000", "async"]),
]


@pytest.mark.parametrize("key, var, bad, good", BOUNDS)
def test_env_loader_and_engine_init_share_the_bounds(standalone, key, var, bad, good):
    for value in bad:
        with pytest.raises(ConfigError, match=rf"{var} must be .*Received: {var}="):
            read_env({var: str(value)})
        with pytest.raises(ConfigError) as from_loader:
            load_config(overrides=[f"comm.{key}={value}"])
        with pytest.raises(ConfigError) as from_engine:
            engine.init({key: value})
        # engine.init goes through the Trainer's validation: the very same message.
        assert str(from_engine.value) == str(from_loader.value)
        assert f"Received: comm.{key}=" in str(from_engine.value)
    for value in good:
        assert read_env({var: str(value)}).comm[key] == value
        assert load_config(overrides=[f"comm.{key}={value}"]).comm[key] == value
        assert comm_options({key: value}) == {key: value}


def test_unknown_key_is_the_same_error_for_engine_init_and_the_trainer(standalone):
    with pytest.raises(ConfigError) as from_engine:
        engine.init({"connection_per_server": 2})
    with pytest.raises(ConfigError) as from_loader:
        load_config({"comm": {"connection_per_server": 2}})
    assert str(from_engine.value) == str(from_loader.value)
    assert "Did you mean 'comm.connections_per_server'?" in str(from_engine.value)


def test_engine_init_keeps_the_environment_for_keys_not_given(standalone, monkeypatch):
    monkeypatch.setenv("BPSTRAIN_OP_TIMEOUT", "7")
    monkeypatch.setenv("BYTEPS_PARTITION_BYTES", "4096")
    engine.init({"partition_bytes": 1024, "hierarchical": "yes", "secret": "s"})
    options = engine.options()
    assert (options["op_timeout"], options["partition_bytes"]) == (7.0, 1024)
    assert (options["hierarchical"], options["secret"]) == ("true", "s")


def test_first_environment_variable_wins():
    env = read_env({"BPSTRAIN_PARTITION_BYTES": "0", "BYTEPS_PARTITION_BYTES": "65536"})
    assert env.comm["partition_bytes"] == 0  # 0 = auto, not "unset"
    assert read_env({"BYTEPS_SERVER_ENGINE_THREAD": "3"}).comm["engine_threads"] == 3
    with pytest.raises(ConfigError, match="BPSTRAIN_PRIORITY must be 0/1/true/false"):
        read_env({"BPSTRAIN_PRIORITY": "maybe"})


RULES = [{"pattern": "*.weight", "min_size": 65536, "compression": "topk:0.01"},
         {"pattern": "*.bias", "compression": "none"}]


def test_comm_compression_keys_load_from_config_overrides_and_environment(standalone):
    cfg = load_config({"comm": {"compression": "onebit", "compression_rules": RULES,
                                "compression_min_size": 4096}})
    assert cfg.comm.compression == "onebit" and cfg.comm.compression_min_size == 4096
    assert [dict(r) for r in cfg.comm.compression_rules] == RULES
    assert CommConfig().compression == "none" and CommConfig().compression_rules == []
    for spec in ("none", "fp16", "bf16", "onebit", "topk:0.01", "randomk:0.05", "dithering:16",
                 "powersgd:2", "auto", "auto:topk:0.01", "onebit:scaled=false",
                 "topk:0.01,error_feedback=false"):
        assert load_config(overrides=[f"comm.compression={spec}"]).comm.compression == spec
    env = read_env({"BPSTRAIN_COMPRESSION": "topk:0.01", "BPSTRAIN_COMPRESSION_MIN_SIZE": "0",
                    "BPSTRAIN_COMPRESSION_RULES": "[{pattern: '*.bias', compression: fp16}]"})
    assert env.comm == {"compression": "topk:0.01", "compression_min_size": 0,
                        "compression_rules": [{"pattern": "*.bias", "compression": "fp16"}]}
    engine.init({"compression": "powersgd:2", "compression_rules": RULES})
    assert engine.options()["compression"] == "powersgd:2"
    assert engine.options()["compression_rules"] == RULES


BAD_COMPRESSION = [  # key, value, what the message must say
    ("compression", "topk", r"topk needs a ratio in \(0, 1\]"),
    ("compression", "topk:1.5", r"topk needs a ratio"),
    ("compression", "zip", r"unknown compression; expected one of none, fp16"),
    ("compression", "dithering:200", r"levels in 1..127"),
    ("compression", "onebit:ratio=0.1", r"onebit takes scaled"),
    ("compression_rules", [{"patern": "*"}], r"a compression rule is \{pattern"),
    ("compression_rules", [{"pattern": "*", "compression": "powersgd:0"}], r"rank >= 1"),
    ("compression_min_size", -1, r"an integer >= 0"),
]


@pytest.mark.parametrize("key, value, why", BAD_COMPRESSION)
def test_bad_compression_keys_name_the_key_and_say_why(standalone, key, value, why):
    with pytest.raises(ConfigError) as from_loader:
        load_config({"comm": {key: value}})
    message = str(from_loader.value)
    assert message.startswith(f"Config key 'comm.{key}' must be ") and "Received: comm." in message
    assert re.search(why, message), message
    with pytest.raises(ConfigError) as from_engine:
        engine.init({key: value})
    assert str(from_engine.value) == message


def test_bad_compression_environment_variable_is_named(standalone):
    with pytest.raises(ConfigError, match=r"BPSTRAIN_COMPRESSION must be a compression spec.*"
                       r"Received: BPSTRAIN_COMPRESSION='topk:2'"):
        read_env({"BPSTRAIN_COMPRESSION": "topk:2"})
    with pytest.raises(ConfigError, match=r"BPSTRAIN_COMPRESSION_RULES must be"):
        read_env({"BPSTRAIN_COMPRESSION_RULES": "[{pattern: '*', compression: zip}]"})


def test_yaml_booleans_for_hierarchical_are_read_as_words():
    assert load_config({"comm": {"hierarchical": True}}).comm.hierarchical == "true"


def test_the_config_layer_imports_no_models():
    probe = ("import sys; from bpstrain.config import load_config; "
             "load_config(overrides=['model.name=anything']); "
             "print('bpstrain.models' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_compression_keys_travel_as_environment_variables_and_back():
    # How the Ray launcher hands the comm section to every role.
    from bpstrain.ray._fit import comm_env

    given = {"compression": "topk:0.01", "compression_rules": RULES, "compression_min_size": 0}
    env = comm_env(given)
    assert set(env) == {"BPSTRAIN_COMPRESSION", "BPSTRAIN_COMPRESSION_RULES",
                        "BPSTRAIN_COMPRESSION_MIN_SIZE"}
    assert read_env(env).comm == given
