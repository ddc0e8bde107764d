"""The install script's torch source, and the extras a fresh clone needs."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _install(*args, **env):
    return subprocess.run(["bash", str(ROOT / ".ci" / "install"), "--dry-run", *args],
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, **env})


@pytest.mark.timeout(60)
def test_install_script_default_is_what_ci_ran_and_cpu_uses_the_cpu_index():
    default = _install()
    assert default.returncode == 0, default.stderr
    commands = [l for l in default.stdout.splitlines() if "pip install" in l]
    assert commands == ["+ python -m pip install -q --upgrade pip",
                        "+ python -m pip install -q torch==2.13.0",
                        "+ python -m pip install -q -e "
                        ".[dev,tensorflow,notebook,lightning,accelerate,ray]"]
    assert "from pip's configured index (default)" in default.stderr
    for cpu in (_install("--cpu"), _install(BPSTRAIN_TORCH="cpu")):
        assert cpu.returncode == 0, cpu.stderr
        assert ("+ python -m pip install -q torch==2.13.0 --index-url "
                "https://download.pytorch.org/whl/cpu") in cpu.stdout
        assert "CPU-only wheel" in cpu.stderr
    bad = _install(BPSTRAIN_TORCH="cuda")
    assert bad.returncode == 2 and "Received: cuda" in bad.stderr


@pytest.mark.timeout(60)
def test_notebook_extra_opens_notebooks_and_tensorboard_has_an_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {e.split(">")[0].split("=")[0] for e in extras["notebook"]}
    assert {"jupyterlab", "nbconvert", "ipykernel", "ipywidgets"} <= names
    assert any(e.startswith("tensorboard") for e in extras["tensorboard"])
    assert any(e.startswith("tensorboard") for e in extras["dev"])  # the tests use it
    lab = subprocess.run([sys.executable, "-m", "jupyterlab", "--version"],
                         capture_output=True, text=True, timeout=50)
    assert lab.returncode == 0, lab.stderr
