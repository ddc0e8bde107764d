"""The README's notebook snippet and the notebooks draw each plot once."""

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(30)
def test_a_plot_as_the_last_expression_ends_with_a_semicolon():
    # plot() returns the figure: as a cell's last expression Jupyter would draw it again.
    readme = (ROOT / "README.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", readme, re.S)
    last_lines = [s.strip().splitlines()[-1] for s in snippets if ".plot()" in s]
    assert last_lines, "the README's notebook snippet calls history.plot()"
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        last_lines += [c.source.strip().splitlines()[-1] for c in nb.cells
                       if c.cell_type == "code" and c.source.strip()]
    for line in last_lines:
        code = line.split("#")[0].strip()
        if code.endswith(".plot()") or re.search(r"\.plot\(.*\)$", code):
            pytest.fail(f"end the line with ';' so the figure is drawn once: {line!r}")
