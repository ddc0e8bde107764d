"""Recipes: named YAML configs merged over the schema, plus command-line overrides.

    python -m bpstrain.recipe resnet50 cluster.workers=2 trainer.steps=20
    python -m bpstrain.recipe --list
    python -m bpstrain.recipe digits --print

A recipe is looked up in the repository's top-level ``recipes/`` when running from a
source checkout (editable install), then among the package data
``bpstrain/recipes/*.yaml`` (an installed wheel). A path to a YAML file works as a
recipe name too.

Example:
    >>> from bpstrain.recipe import load_recipe
    >>> cfg = load_recipe("digits", ["trainer.epochs=1"])
    >>> cfg.model.name
    'digits_mlp'
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Union

from omegaconf import DictConfig

from bpstrain.config import ConfigError, load_config

_SUFFIXES = (".yaml", ".yml")


class RecipeNotFoundError(ConfigError, LookupError):
    """No recipe of that name; the message lists the available ones."""


class TrainerUnavailableError(RuntimeError):
    """``bpstrain.trainer.run_recipe`` cannot be imported, so recipes cannot run."""


def _search_dirs() -> List[Any]:
    """Recipe folders, most authoritative first (Traversable or Path).

    A source checkout's ``recipes/`` comes first: an editable install also has a
    copy in the package data, but that copy is a snapshot from the last build.
    """
    dirs: List[Any] = []
    root = Path(__file__).resolve().parents[2]  # <repo> in a checkout
    if (root / "pyproject.toml").is_file() and (root / "recipes").is_dir():
        dirs.append(root / "recipes")
    try:
        packaged = resources.files("bpstrain").joinpath("recipes")
        if packaged.is_dir() and not (dirs and Path(str(packaged)) == dirs[0]):
            dirs.append(packaged)
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        pass
    return dirs


def _recipe_files() -> Dict[str, Any]:
    """Recipe name -> file; a name found in an earlier folder wins."""
    found: Dict[str, Any] = {}
    for folder in _search_dirs():
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            stem, suffix = os.path.splitext(entry.name)
            if suffix in _SUFFIXES and entry.is_file() and not stem.startswith("_"):
                found.setdefault(stem, entry)
    return found


def list_recipes() -> List[str]:
    """Names of the available recipes, sorted."""
    return sorted(_recipe_files())


def describe_recipe(name: str) -> str:
    """The first comment line of a recipe: its one-line description ('' if none)."""
    text = recipe_text(name)
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def recipe_text(name: Union[str, os.PathLike]) -> str:
    """The YAML text of a recipe, by name or by path.

    Raises:
        RecipeNotFoundError: not a recipe name and not an existing YAML file.
    """
    path = Path(name)
    if path.suffix in _SUFFIXES or os.sep in str(name) or isinstance(name, os.PathLike):
        if path.is_file():
            return path.read_text()
        raise RecipeNotFoundError(
            f"Recipe file not found; expected an existing YAML file or one of: "
            f"{', '.join(list_recipes())}. Received: recipe={str(name)!r}")
    files = _recipe_files()
    if str(name) not in files:
        import difflib

        close = difflib.get_close_matches(str(name), list(files), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise RecipeNotFoundError(
            f"Unknown recipe.{hint} Available: {', '.join(sorted(files)) or 'none found'} "
            f"(or pass a path to a YAML file). Received: recipe={name!r}")
    return files[str(name)].read_text()


def load_recipe(name: Union[str, os.PathLike],
                overrides: Iterable[str] = ()) -> DictConfig:
    """A recipe merged over the schema defaults, then ``key=value`` overrides.

    Returns:
        The validated, struct-mode config (see :func:`bpstrain.config.load_config`).

    Raises:
        RecipeNotFoundError: unknown recipe; the message lists the available ones.
        ConfigError: the recipe or an override has an unknown or invalid key.
    """
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    text = recipe_text(name)
    try:
        data = OmegaConf.create(text) if text.strip() else {}
    except (OmegaConfBaseException, yaml.YAMLError) as err:
        raise ConfigError(f"Recipe {str(name)!r} is not valid YAML: {err}. "
                          f"Received: recipe={str(name)!r}") from None
    from bpstrain.models import check_model_name  # torch-free registry

    try:
        cfg = load_config(data, list(overrides))
        if cfg.model.name is not None:
            check_model_name(cfg.model.name, "model.name")
        if cfg.data.name == "synthetic" and cfg.data.path:
            raise ConfigError("data.path is read only with data.name=image_folder; this recipe "
                              "trains on synthetic data. Add data.name=image_folder. Received: "
                              f"data.name='synthetic', data.path={cfg.data.path!r}")
    except ConfigError as err:
        raise type(err)(f"Recipe {str(name)!r}: {err}") from None
    return cfg


def run(name: Union[str, os.PathLike], overrides: Iterable[str] = ()) -> Optional[Any]:
    """Loads a recipe and trains it with ``bpstrain.trainer.run_recipe(cfg)``.

    Returns:
        Whatever ``run_recipe`` returns (the Trainer's history).
    """
    cfg = load_recipe(name, overrides)
    return _run_recipe_fn()(cfg)


def _run_recipe_fn():
    """``bpstrain.trainer.run_recipe``, imported late: the Trainer pulls in torch."""
    try:
        from bpstrain.trainer import run_recipe
    except ImportError as err:
        if getattr(err, "name", None) != "bpstrain.trainer":
            raise  # the Trainer exists but one of its own imports failed
        raise TrainerUnavailableError(
            "Cannot run the recipe: bpstrain.trainer.run_recipe is not available in "
            "this installation. Use --print to see the merged config. "
            f"Received: ImportError({err})") from err
    return run_recipe


__all__ = ["RecipeNotFoundError", "TrainerUnavailableError", "describe_recipe",
           "list_recipes", "load_recipe", "recipe_text", "run"]
