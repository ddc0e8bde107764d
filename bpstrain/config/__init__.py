"""bpstrain configuration: one typed OmegaConf schema, one loader.

Example:
    >>> from bpstrain.config import load_config, to_comm_config
    >>> cfg = load_config({"trainer.epochs": 2}, ["comm.partition_bytes=1048576"])
    >>> to_comm_config(cfg).partition_bytes
    1048576

See :mod:`bpstrain.config.schema` for every key, its type and default, and
:mod:`bpstrain.config.env` for the DMLC_* / BYTEPS_* environment variables.
"""

from bpstrain.config.env import ClusterEnv, read_env
from bpstrain.config.loader import (
    ConfigError,
    comm_options,
    config_to_yaml,
    load_config,
    save_config,
    to_comm_config,
)
from bpstrain.config.schema import (
    ClusterConfig,
    CommConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    TrainerConfig,
)

__all__ = [
    "ClusterConfig",
    "ClusterEnv",
    "CommConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimizerConfig",
    "TrainerConfig",
    "comm_options",
    "config_to_yaml",
    "load_config",
    "read_env",
    "save_config",
    "to_comm_config",
]
