"""Every notebook in notebooks/ runs headless (nbclient) on a kernel of this venv's python.

Notebooks are committed without outputs; each run starts a fresh kernel in a temporary
folder, so ``runs/`` and friends land there. After a notebook, no process it started
may be left (the kernel's own children are checked through the kernel's pid).
"""

import json
import sys
from pathlib import Path

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
KERNEL = "bpstrain-venv"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """A kernelspec that runs this interpreter (the venv's), found through JUPYTER_PATH."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "bpstrain venv", "language": "python"}))
    return root


def _run(name, tmp_path, kernel_dir, monkeypatch, timeout=150):
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_dir))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{name}.ipynb must be committed without outputs")
    client = NotebookClient(nb, timeout=timeout, kernel_name=KERNEL,
                            resources={"metadata": {"path": str(tmp_path)}})
    leftovers = []
    with client.setup_kernel():
        kernel = psutil.Process(client.km.provisioner.process.pid)
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)  # CellExecutionError shows the cell's traceback
        leftovers = [p for p in kernel.children(recursive=True)
                     if "resource_tracker" not in " ".join(p.cmdline())]
    assert leftovers == [], f"{name}.ipynb left processes behind: {leftovers}"
    return nb


def _outputs(nb, kind):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == kind or o.get("name") == kind]


def _has_image(nb):
    return any("image/png" in o.get("data", {}) for o in _outputs(nb, "display_data"))


@pytest.mark.timeout(240)
def test_quickstart_notebook(tmp_path, kernel_dir, monkeypatch):
    nb = _run("quickstart", tmp_path, kernel_dir, monkeypatch)
    assert _has_image(nb)  # history.plot()
    stdout = "".join(o["text"] for o in _outputs(nb, "stdout"))
    assert "test accuracy of the model in this notebook" in stdout
    assert "trainer.test: test_loss=" in stdout
    run = tmp_path / "runs" / "quickstart2" / "version_0"  # the notebook's run folder
    assert (run / "timeline.json").is_file() and (run / "config.yaml").is_file()
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "runs" / "quickstart" / "version_0" / "metrics.csv").is_file()


@pytest.mark.timeout(240)
def test_keras_notebook(tmp_path, kernel_dir, monkeypatch):
    nb = _run("keras", tmp_path, kernel_dir, monkeypatch)
    assert _has_image(nb)
    stdout = "".join(o["text"] for o in _outputs(nb, "stdout"))
    assert "test accuracy" in stdout and "rank 0 of 1" in stdout
    # Clean outputs: neither bpstrain's "Wrap it before use" (the Trainer wraps the
    # optimizer itself) nor Keras' "Skipping variable loading" from every worker.
    stderr = "".join(o["text"] for o in _outputs(nb, "stderr"))
    assert "Warning" not in stderr, stderr


@pytest.mark.timeout(240)
def test_benchmark_notebook(tmp_path, kernel_dir, monkeypatch):
    nb = _run("benchmark", tmp_path, kernel_dir, monkeypatch)
    assert _has_image(nb)
    stdout = "".join(o["text"] for o in _outputs(nb, "stdout"))
    assert "gloo" in stdout and "bpstrain" in stdout
