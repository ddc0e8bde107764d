"""run_recipe and the recipe CLI on digits."""

import os
import subprocess
import sys
import time

import pytest

from bpstrain.trainer import run_recipe


@pytest.mark.timeout(90)
def test_run_recipe_in_process(tmp_path, capsys):
    history = run_recipe({"trainer.epochs": 3, "trainer.out_dir": str(tmp_path),
                          "trainer.progress": False, "data.name": "digits",
                          "model.name": "digits_mlp", "optimizer.name": "adam",
                          "optimizer.lr": 0.003})
    out = capsys.readouterr().out
    assert "throughput:" in out and "samples/s" in out and "validation accuracy:" in out
    assert "test accuracy" not in out  # the validation split is not a test set
    assert f"run folder: {tmp_path / 'version_0'} (config.yaml, metrics.csv)" in out
    assert (tmp_path / "version_0" / "config.yaml").is_file()
    assert history.last["val_accuracy"] > 0.9
    with pytest.raises(ValueError, match="Received: model.name=None"):
        run_recipe({"data.name": "digits"})


@pytest.mark.timeout(120)
def test_digits_recipe_cli_with_two_workers_reaches_95_percent(tmp_path):
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "bpstrain.recipe", "digits", "cluster.workers=2",
         f"trainer.out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=110, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.startswith("validation accuracy:"))
    assert float(line.split()[2]) >= 0.95, proc.stdout
    assert "2 worker(s)" in proc.stdout and "samples/s" in proc.stdout
    assert elapsed < 60, f"took {elapsed:.1f} s"
