"""`python -m bpstrain.bench --help` lists every benchmark the README runs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_help_lists_every_benchmark_the_readme_uses():
    readme = (ROOT / "README.md").read_text()
    used = set(re.findall(r"python -m bpstrain\.bench\.(\w+)", readme))
    used |= {m for m in re.findall(r"python -m bpstrain\.bench ([\w-]+)", readme)}
    assert {"priority", "summation", "training", "cluster", "scaling"} <= used
    proc = subprocess.run([sys.executable, "-m", "bpstrain.bench", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    for name in used:
        assert re.search(rf"(bench\.{name}\b|\b{name}\s{{2,}}\S)", proc.stdout), (name,
                                                                               proc.stdout)
