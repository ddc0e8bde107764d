"""Load, validate and save bpstrain configs.

One funnel, :func:`load_config`, turns whatever the user has (the :class:`Config`
dataclass, a ``DictConfig``, a nested or dotted ``dict``, a YAML path or nothing)
plus ``key=value`` overrides into a validated, struct-mode ``DictConfig``. Unknown
keys, wrong types and out-of-range values fail here, with the key named and the
closest valid key suggested, instead of deep inside a worker process.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from bpstrain.config import schema
from bpstrain.config.schema import CommConfig, Config
from bpstrain.errors import ConfigError  # one class for every config error

__all__ = ["ConfigError", "comm_options", "config_to_yaml", "load_config", "save_config",
           "to_comm_config"]


ConfigLike = Union[Config, DictConfig, Mapping[str, Any], str, os.PathLike, None]
Overrides = Union[Iterable[str], Mapping[str, Any]]

_SECTIONS = {tp: name for name, tp in typing.get_type_hints(Config).items()}


# --------------------------------------------------------------------------- schema


def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _strip_optional(tp: Any) -> tuple:
    """Returns (inner type, optional?) for ``Optional[X]``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _strip_optional(tp)
    origin = typing.get_origin(inner)
    if origin in (list, typing.List):
        name = f"list of {_type_name(typing.get_args(inner)[0])}"
    elif origin in (dict, typing.Dict):
        name = "mapping"
    elif dataclasses.is_dataclass(inner):
        name = "section"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or null" if optional else name


def _field_type(path: list) -> Optional[Any]:
    """The schema type at a dotted path; None when the path is not in the schema."""
    tp: Any = Config
    for key in path:
        inner, _ = _strip_optional(tp)
        if typing.get_origin(inner) in (dict, typing.Dict):
            return Any  # free-form mapping such as model.kwargs
        if not dataclasses.is_dataclass(inner) or key not in _hints(inner):
            return None
        tp = _hints(inner)[key]
    return tp


def _all_keys(cls: type = Config, prefix: str = "") -> list:
    keys = []
    for name, tp in _hints(cls).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(tp):
            keys.extend(_all_keys(tp, f"{prefix}{name}."))
    return keys


def _suggest(bad_key: str, siblings: list) -> Optional[str]:
    """The closest valid key: same leaf name elsewhere, else the most similar key."""
    leaf = bad_key.rsplit(".", 1)[-1]
    everything = _all_keys()
    same_leaf = [k for k in everything if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return same_leaf[0]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        parent = bad_key.rsplit(".", 1)[0] + "." if "." in bad_key else ""
        return parent + close[0]
    close = difflib.get_close_matches(bad_key, everything, n=1, cutoff=0.6)
    return close[0] if close else None


def _first_leaf(value: Any) -> str:
    """The rest of the dotted key the user typed: '.lr' for {'lr': 1}."""
    if isinstance(value, dict) and value:
        key = next(iter(value))
        return f".{key}{_first_leaf(value[key])}"
    return ""


def _unknown_key(full_key: str, siblings: list, value: Any = None) -> ConfigError:
    hint = _suggest(full_key, siblings)
    parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    rest = _first_leaf(value)
    if rest:  # a misspelt section: name the whole key, suggest the whole fix
        if hint and (hint + rest) in _all_keys():
            hint += rest
        full_key += rest
    where = f"under '{parent}'" if parent else "at the top level"
    return ConfigError(
        f"Unknown config key '{full_key}'."
        + (f" Did you mean '{hint}'?" if hint else "")
        + f" Valid keys {where}: {', '.join(sorted(siblings))}."
        + f" Received: key={full_key}")


# ---------------------------------------------------------------------- user input


def _nest(flat: Mapping[str, Any]) -> dict:
    """Expands dotted keys: {"a.b": 1, "a": {"c": 2}} -> {"a": {"b": 1, "c": 2}}."""
    out: dict = {}
    for key, value in flat.items():
        if isinstance(value, Mapping) and not isinstance(value, DictConfig):
            value = _nest(value)
        *parents, leaf = str(key).split(".")
        node = out
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"Config key '{'.'.join(parents[:i + 1])}' is given both as a value "
                    f"and as a section. Received: key={key}")
        if isinstance(node.get(leaf), dict) and isinstance(value, dict):
            node[leaf] = _nest({**node[leaf], **value})
        else:
            node[leaf] = value
    return out


def _as_dict(cfg: ConfigLike) -> dict:
    """Any accepted config form -> a plain nested dict (interpolations kept)."""
    if cfg is None:
        return {}
    if isinstance(cfg, (str, os.PathLike)):
        path = Path(cfg)
        if not path.is_file():
            raise FileNotFoundError(
                f"Config file not found; expected a YAML file. Received: path={str(path)!r}")
        try:
            cfg = OmegaConf.load(path)
        except (OmegaConfBaseException, yaml.YAMLError) as err:
            raise ConfigError(f"Config file is not valid YAML: {err}. "
                              f"Received: path={str(path)!r}") from None
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        section = _SECTIONS.get(type(cfg))
        cfg = OmegaConf.structured(cfg)
        if section is not None:  # a single section such as CommConfig(...)
            cfg = OmegaConf.create({section: cfg})
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=False)
    if isinstance(cfg, Mapping):
        return OmegaConf.to_container(OmegaConf.create(_nest(cfg)), resolve=False)
    raise ConfigError(
        "Expected a Config, DictConfig, dict, YAML path or None as the config. "
        f"Received: cfg={type(cfg).__name__}")


def _parse_overrides(overrides: Overrides) -> dict:
    """``["a.b=1", ...]`` -> nested dict; string fields keep the raw text."""
    if isinstance(overrides, Mapping):
        return _as_dict(overrides)
    if isinstance(overrides, str):
        overrides = [overrides]
    flat: dict = {}
    for item in overrides:
        key, sep, raw = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"Expected an override of the form key=value, e.g. trainer.epochs=3. "
                f"Received: {item!r}")
        try:  # resolve=False: `${data.num_classes}` refers to the merged config
            parsed = OmegaConf.from_dotlist([f"x={raw}"]) if raw else {"x": ""}
            value = OmegaConf.to_container(OmegaConf.create(parsed), resolve=False)["x"]
        except (OmegaConfBaseException, yaml.YAMLError) as err:
            raise ConfigError(f"Override {key!r} has a value that is not valid YAML "
                              f"({str(err).splitlines()[0]}). Received: {item!r}") from None
        inner, _ = _strip_optional(_field_type(key.split(".")) or Any)
        # YAML reads `numa=off` as False and `secret=123` as 123; a str field
        # wants the text the user typed.
        if inner is str and value is not None and not isinstance(value, str):
            value = raw.strip()
        flat[key] = value
    return _nest(flat)


def _check_keys(user: dict, cls: type, prefix: str = "") -> None:
    """Rejects unknown keys and non-mapping sections; repairs YAML booleans."""
    hints = _hints(cls)
    for key in list(user):
        full = f"{prefix}{key}"
        if full in schema.NOT_AVAILABLE:
            raise ConfigError(f"{schema.NOT_AVAILABLE[full]}. Received: {full}={user[key]!r}")
        if key not in hints:
            raise _unknown_key(full, list(hints), user[key])
        tp, value = hints[key], user[key]
        inner, _ = _strip_optional(tp)
        if dataclasses.is_dataclass(inner):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"Config key '{full}' is a section; expected a mapping of its keys "
                    f"({', '.join(_hints(inner))}). Received: {full}={value!r}")
            _check_keys(value, inner, full + ".")
        elif inner is str and isinstance(value, bool):
            if full == "comm.numa":  # `numa: off` in YAML; false means off too
                user[key] = "auto" if value else "off"
            elif full == "comm.hierarchical":  # `hierarchical: true` in YAML
                user[key] = "true" if value else "false"
            else:
                raise ConfigError(
                    f"Config key '{full}' expects a string; unquoted YAML words like "
                    f"off/on/yes/no read as booleans, so quote them. Received: {full}={value!r}")


def _from_omegaconf(err: OmegaConfBaseException) -> ConfigError:
    full = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
    tp = _field_type(str(full).split("."))
    if isinstance(err, InterpolationResolutionError):
        expects = " has an interpolation that cannot be resolved"
    elif tp not in (None, Any):
        expects = f" expects {_type_name(tp)}"
    else:
        expects = " is invalid"
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    value = getattr(err, "value", None)
    received = f"{full}={value!r}" if value is not None else f"key={full}"
    return ConfigError(f"Config key '{full}'{expects}: {first}. Received: {received}")


# ---------------------------------------------------------------------- validation


def _fail(key: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"Config key '{key}' must be {expected}. Received: {key}={value!r}")


def _choice(key: str, value: Any, choices: Iterable[str]) -> None:
    choices = list(choices)
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise _fail(key, f"one of {', '.join(map(repr, choices))}{hint}", value)


def _at_least(key: str, value: Any, low: float, optional: bool = False) -> None:
    if optional and value is None:
        return
    if value is None or value < low:
        raise _fail(key, f">= {low}" + (" or null" if optional else ""), value)


def _validate(cfg: Config) -> None:
    """Range and choice checks that the type system cannot express."""
    t, d, o, c, m = cfg.trainer, cfg.data, cfg.optimizer, cfg.cluster, cfg.comm
    for key in ("epochs", "batch_size", "log_every"):
        _at_least(f"trainer.{key}", getattr(t, key), 1)
    for key in ("steps", "val_steps"):
        _at_least(f"trainer.{key}", getattr(t, key), 1, optional=True)
    for key in ("val_every", "checkpoint_every", "early_stopping_patience"):
        _at_least(f"trainer.{key}", getattr(t, key), 0)
    _choice("trainer.loss", t.loss, schema.LOSSES)
    _choice("trainer.device", t.device, schema.DEVICES)
    if not t.out_dir:
        raise _fail("trainer.out_dir", "a non-empty directory path", t.out_dir)
    _choice("trainer.precision", t.precision, schema.PRECISIONS)
    _choice("trainer.gradient_clip_algorithm", t.gradient_clip_algorithm,
            schema.CLIP_ALGORITHMS)
    if t.gradient_clip_val is not None and not t.gradient_clip_val > 0:
        raise _fail("trainer.gradient_clip_val", "> 0 or null", t.gradient_clip_val)
    _choice("trainer.monitor_mode", t.monitor_mode, schema.MONITOR_MODES)
    _at_least("trainer.save_top_k", t.save_top_k, 0)
    for name in t.loggers:
        _choice("trainer.loggers[]", name, schema.LOGGERS)
    if t.run_name is not None and (not t.run_name or "/" in t.run_name
                                   or t.run_name in (".", "..")):
        raise _fail("trainer.run_name", "a folder name (no '/') or null", t.run_name)

    if d.name is not None:
        _choice("data.name", d.name, schema.DATASETS)
    if d.name == "synthetic" and d.synthetic is False:
        raise _fail("data.synthetic", "true or null when data.name='synthetic'", d.synthetic)
    for key in ("num_classes", "image_size", "channels", "synthetic_samples"):
        _at_least(f"data.{key}", getattr(d, key), 1)
    _at_least("data.loader_workers", d.loader_workers, 0)
    if not 0.0 <= d.val_fraction < 1.0:
        raise _fail("data.val_fraction", "in [0, 1)", d.val_fraction)

    # model.name is checked where models are known (bpstrain.models, the recipes):
    # the config layer knows no models.

    _choice("optimizer.name", o.name, schema.OPTIMIZERS)
    _choice("optimizer.schedule", o.schedule, schema.LR_SCHEDULES)
    if not o.lr > 0:
        raise _fail("optimizer.lr", "> 0", o.lr)
    for key in ("momentum", "weight_decay", "warmup_epochs", "gamma"):
        _at_least(f"optimizer.{key}", getattr(o, key), 0)
    if not o.eps > 0:
        raise _fail("optimizer.eps", "> 0", o.eps)
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise _fail("optimizer.betas", "two numbers in [0, 1)", list(o.betas))
    if any(e < 0 for e in o.step_epochs):
        raise _fail("optimizer.step_epochs", "a list of epochs >= 0", list(o.step_epochs))
    _at_least("optimizer.backward_passes_per_step", o.backward_passes_per_step, 1)

    _at_least("cluster.workers", c.workers, 1)
    _at_least("cluster.servers", c.servers, 1)
    _at_least("cluster.local_size", c.local_size, 1, optional=True)
    if c.local_size is not None and c.workers % c.local_size:
        raise _fail("cluster.local_size",
                    f"a divisor of cluster.workers={c.workers} (workers = hosts * local_size)",
                    c.local_size)
    if not 0 <= c.port <= 65535:
        raise _fail("cluster.port", "in [0, 65535] (0 = pick a free port)", c.port)
    if not c.host:
        raise _fail("cluster.host", "a host name or IP address", c.host)
    if c.secret is not None and not c.secret:
        raise _fail("cluster.secret", "a non-empty string or null", c.secret)
    _choice("cluster.start_method", c.start_method, schema.START_METHODS)
    _choice("cluster.launcher", c.launcher, schema.LAUNCHERS)

    for key, (_, knob) in schema.comm_knobs().items():  # the bounds env.py applies too
        value = getattr(m, key)
        try:
            knob.check(value)
        except ValueError as err:
            raise _fail(f"comm.{key}", str(err), value) from None


# ------------------------------------------------------------------------- public


def load_config(cfg: ConfigLike = None, overrides: Overrides = ()) -> DictConfig:
    """Merges a config and overrides over the schema defaults and validates the result.

    Args:
        cfg: a :class:`Config` (or one section dataclass such as ``CommConfig``), a
            ``DictConfig``, a nested or dotted ``dict`` (``{"trainer.epochs": 3}``),
            a path to a YAML file, or None for all defaults.
        overrides: ``key=value`` strings (values parsed as YAML, as on the command
            line) or a dict; applied after ``cfg``.

    Returns:
        A struct-mode ``DictConfig`` with the schema's types: setting or reading an
        unknown key raises. Interpolations such as ``${data.num_classes}`` are kept.

    Raises:
        ConfigError: a key is unknown (the closest valid key is suggested), a value
            has the wrong type, or is out of range.
        FileNotFoundError: ``cfg`` is a path that does not exist.

    Example:
        >>> cfg = load_config("recipes/digits.yaml", ["trainer.epochs=2"])
    """
    layers = [_as_dict(cfg), _parse_overrides(overrides)]
    for layer in layers:
        _check_keys(layer, Config)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), *layers)
        typed = OmegaConf.to_object(merged)  # resolves interpolations, checks types
    except OmegaConfBaseException as err:
        raise _from_omegaconf(err) from None
    _validate(typed)
    OmegaConf.set_struct(merged, True)
    return merged


def config_to_yaml(cfg: ConfigLike, resolve: bool = True) -> str:
    """The validated config as YAML text, interpolations resolved by default."""
    return OmegaConf.to_yaml(load_config(cfg), resolve=resolve)


def save_config(cfg: ConfigLike, path: Union[str, os.PathLike]) -> Path:
    """Validates ``cfg`` and writes it, resolved, as YAML to ``path``.

    Parent directories are created. The file loads back with :func:`load_config`.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_to_yaml(cfg))
    return path


def to_comm_config(cfg: ConfigLike = None) -> CommConfig:
    """The ``comm`` section as a :class:`CommConfig` instance for the engine.

    Args:
        cfg: anything :func:`load_config` accepts (a whole config), a ``CommConfig``,
            or a mapping of comm keys only (``{"partition_bytes": 1024}``).
    """
    if isinstance(cfg, Mapping) and cfg and not any(
            str(k).split(".")[0] in _SECTIONS.values() for k in cfg):
        cfg = {"comm": cfg}
    return OmegaConf.to_object(load_config(cfg).comm)


def comm_options(given: Any = None) -> dict:
    """Validates comm options given to :func:`bpstrain.engine.init`; returns the given keys.

    The same checks as a whole config's ``comm`` section (unknown keys with the closest
    one suggested, types, bounds), so ``engine.init(config)`` fails exactly as the
    Trainer does. Keys not given are left out: the environment fills them.

    Args:
        given: None, a mapping of comm keys (``{"partition_bytes": 1024}``; ``secret``
            too), a :class:`CommConfig` (every key counts as given) or a ``DictConfig``
            of the ``comm`` section.

    Raises:
        ConfigError: a key is unknown, a value has the wrong type or is out of range.
    """
    if given is None:
        return {}
    if isinstance(given, CommConfig):
        given = dataclasses.asdict(given)
    elif isinstance(given, DictConfig):
        given = OmegaConf.to_container(given, resolve=True)
    elif not isinstance(given, Mapping):
        raise ConfigError("init(config=...) takes a dict, CommConfig or DictConfig of comm "
                          f"options. Received: {type(given).__name__}")
    given = dict(given)
    secret = given.pop("secret", None)
    comm, knobs = load_config({"comm": given}).comm, schema.comm_knobs()
    options = {key: knobs[key][1].check(comm[key]) for key in given}  # choices normalized
    if secret:
        options["secret"] = str(secret)
    return options
