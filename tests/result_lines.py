"""The one-line JSON results that the worker scripts of multi-process tests print, and
how the tests read them back."""

import json
import re
import sys


def write_result(record: dict, tag: str = "RESULT") -> None:
    """Prints ``TAG {json}`` in one write, flushed. Processes of one job share a stdout (a
    launcher's pipe, or a worker started by another worker), and print's separate write of
    the newline (PYTHONUNBUFFERED) lets another process's output land inside the line; one
    write well under PIPE_BUF is atomic."""
    sys.stdout.write(f"{tag} {json.dumps(record)}\n")
    sys.stdout.flush()


def read_results(text: str, tag: str = "RESULT") -> list[dict]:
    """Every ``TAG {json}`` record in ``text``, in order (a launcher's line prefix is
    allowed; ``RESULT`` does not match inside ``FT_RESULT``)."""
    pattern = re.compile(rf"(?<!\w){re.escape(tag)} (.*)$")
    return [json.loads(m.group(1)) for m in map(pattern.search, text.splitlines()) if m]


def results_by_rank(text: str, tag: str = "RESULT") -> dict:
    """The ``TAG`` records of ``text`` keyed by their ``rank``."""
    return {r["rank"]: r for r in read_results(text, tag)}
