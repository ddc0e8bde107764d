"""Entry point of ``python -m bpstrain.bench``; see ``bpstrain.bench.cli``.

``--help`` also lists the benchmarks that run as modules of their own
(``python -m bpstrain.bench.<name>``), found in the package rather than kept in a
list here, so a new benchmark module shows up by itself.
"""

import ast
import argparse
import sys
import textwrap
from pathlib import Path

from bpstrain.bench.cli import build_parser, main

_NOT_BENCHMARKS = {"cli", "__main__", "__init__"}


def standalone_benchmarks(subcommands) -> list:
    """``(module name, first docstring line)`` of public bench modules with a ``__main__``
    guard that are not also a subcommand."""
    found = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        name = path.stem
        if name.startswith("_") or name in _NOT_BENCHMARKS or name in subcommands:
            continue
        source = path.read_text(encoding="utf-8")
        if 'if __name__ == "__main__":' not in source:
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        first = doc.splitlines()[0] if doc else ""
        prefix = f"``python -m bpstrain.bench.{name}``:"
        found.append((name, first.replace(prefix, "").strip().rstrip(":")))
    return found


def _help() -> str:
    parser = build_parser()
    subcommands = set()
    for action in parser._actions:  # argparse keeps subcommands on its subparsers action
        if isinstance(action, argparse._SubParsersAction):
            subcommands |= set(action.choices)
    lines = ["more benchmarks, each its own module (python -m bpstrain.bench.NAME):"]
    for name, text in standalone_benchmarks(subcommands):
        lines.append(textwrap.fill(text, width=88, initial_indent=f"  {'bench.' + name:<20}",
                                   subsequent_indent=" " * 22))
    lines.append("")
    lines.append("Without a subcommand the loopback benchmark runs; "
                 "`... SUBCOMMAND --help` or `python -m bpstrain.bench.NAME --help` "
                 "shows the options.")
    parser.epilog = "\n".join(lines)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser.format_help()


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(_help(), end="")
        sys.exit(0)
    sys.exit(main())
