"""Reference models and demo data, plain torch (no torchvision).

Models are built by name from a registry, so recipes can say ``model.name: resnet50``:

    >>> from bpstrain.models import get_model, list_models
    >>> model = get_model("digits_mlp", hidden=32)
    >>> "resnet50" in list_models()
    True

Importing this package does not import torch: the registry stores
``"module:function"`` paths, and recipes validate ``model.name`` against it
(:func:`check_model_name`) when they are loaded. Torch is imported when a model or
dataset is built.

Registered: resnet50/101/152 and vgg16/vgg16_bn (torchvision's exact layers and
``state_dict`` keys), digits_mlp and digits_cnn (tiny, for sklearn's 8x8 digits).
Data helpers: :func:`synthetic_dataset`, :func:`digits_dataset`,
:func:`build_datasets`, :class:`ImageFolderDataset`.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any, Callable, Dict, List, Optional, Union

from bpstrain.errors import ConfigError

_REGISTRY: Dict[str, Union[str, Callable[..., Any]]] = {
    "resnet50": "bpstrain.models.resnet:resnet50",
    "resnet101": "bpstrain.models.resnet:resnet101",
    "resnet152": "bpstrain.models.resnet:resnet152",
    "vgg16": "bpstrain.models.vgg:vgg16",
    "vgg16_bn": "bpstrain.models.vgg:vgg16_bn",
    "digits_mlp": "bpstrain.models.small:digits_mlp",
    "digits_cnn": "bpstrain.models.small:digits_cnn",
}

# Public names served lazily from submodules that import torch.
_LAZY = {
    "synthetic_dataset": "data", "digits_dataset": "data", "build_datasets": "data",
    "uses_synthetic_data": "data", "SyntheticDataset": "data",
    "ImageFolderDataset": "_image_folder", "image_folder_datasets": "_image_folder",
    "ResNet": "resnet", "VGG": "vgg", "DigitsMLP": "small", "DigitsCNN": "small",
}


def list_models() -> List[str]:
    """Names accepted by :func:`get_model`, sorted."""
    return sorted(_REGISTRY)


def register_model(name: str, factory: Optional[Callable[..., Any]] = None):
    """Registers ``factory`` (returns an ``nn.Module``) under ``name``.

    Usable as a decorator: ``@register_model("my_net")``. Registering a name again
    replaces the old factory. Registration is per process: in a ``spawn``-ed worker,
    register at import time of a module the worker imports.
    """
    if not name or not isinstance(name, str):
        raise ConfigError(f"Expected a non-empty model name. Received: name={name!r}")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        _REGISTRY[name] = fn
        return fn

    return decorate(factory) if factory is not None else decorate


def check_model_name(name: str, key: str = "name") -> None:
    """Raises ConfigError unless ``name`` is registered; ``key`` is how the message names it
    (``model.name`` for a config: the config layer itself knows no models)."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"Unknown model.{hint} Expected one of: {', '.join(list_models())}. "
            f"Received: {key}={name!r}")


def _factory(name: str) -> Callable[..., Any]:
    check_model_name(name)
    target = _REGISTRY[name]
    if isinstance(target, str):
        module, attr = target.split(":")
        target = getattr(importlib.import_module(module), attr)
    return target


def get_model(name: str, **kwargs: Any):
    """Builds the registered model ``name`` with ``kwargs`` (e.g. ``num_classes=10``).

    Raises:
        ConfigError: (a ValueError) unknown name or keyword argument; the closest
            valid one is suggested.
    """
    factory = _factory(name)
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for key in kwargs:
        if not takes_any and key not in params:
            close = difflib.get_close_matches(key, list(params), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"Model {name!r} has no argument {key!r}.{hint} Accepted: "
                f"{', '.join(params) or 'none'}. Received: key=model.kwargs.{key}")
    return factory(**kwargs)


def build_model(cfg: Any):
    """The model a config's ``model`` section names: ``get_model(name, **kwargs)``."""
    from omegaconf import OmegaConf

    from bpstrain.config import load_config

    cfg = load_config(cfg)
    if cfg.model.name is None:
        raise ConfigError("model.name is not set: pass the model to Trainer.fit() or set "
                         "model.name. Received: model.name=None")
    return get_model(cfg.model.name, **OmegaConf.to_container(cfg.model.kwargs, resolve=True))


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["build_model", "check_model_name", "get_model", "list_models", "register_model",
           *_LAZY]
