"""``python -m bpstrain.recipe NAME [key=value ...]`` — run a training recipe.

Exit codes: 0 success, 1 the run failed, 2 bad usage (unknown recipe, invalid
config key or value), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from bpstrain.config import ConfigError, config_to_yaml
from bpstrain.recipe import (TrainerUnavailableError, describe_recipe, list_recipes,
                             load_recipe, run)

_EPILOG = """\
examples:
  python -m bpstrain.recipe --list
  python -m bpstrain.recipe digits
  python -m bpstrain.recipe resnet50 cluster.workers=2 trainer.steps=20
  python -m bpstrain.recipe vgg16 --print comm.partition_bytes=1048576
  python -m bpstrain.recipe ./my_recipe.yaml trainer.epochs=3

overrides use OmegaConf dotlist syntax: section.key=value (YAML values;
quote strings such as comm.numa=off only inside YAML files, not here)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bpstrain.recipe",
        description="Run a bpstrain training recipe: a YAML config merged over the "
                    "schema defaults, then key=value overrides.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?",
                        help="recipe name (see --list) or path to a YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. trainer.epochs=3 cluster.workers=2")
    parser.add_argument("--list", action="store_true", help="list the available recipes")
    parser.add_argument("--print", action="store_true", dest="print_only",
                        help="print the merged, resolved config as YAML and exit")
    return parser


def _print_list() -> None:
    names = list_recipes()
    if not names:
        print("No recipes found (expected bpstrain/recipes/ or the repository's recipes/).")
        return
    width = max(len(n) for n in names)
    for name in names:
        print(f"{name:<{width}}  {describe_recipe(name)}".rstrip())


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the process exit code."""
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    if args.list:
        _print_list()
        return 0
    if args.recipe is None:
        parser.print_usage(sys.stderr)
        print(f"error: name a recipe (available: {', '.join(list_recipes())}) "
              "or pass --list", file=sys.stderr)
        return 2
    try:
        if args.print_only:
            print(config_to_yaml(load_recipe(args.recipe, args.overrides)), end="")
            return 0
        run(args.recipe, args.overrides)
    except ConfigError as err:  # includes RecipeNotFoundError
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except TrainerUnavailableError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
