"""Trainer.fit inside ``python -m bpstrain.launch`` (DMLC_ROLE=worker): one rank of the job."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_fit_runs_as_one_rank_of_a_launched_job(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bpstrain.launch", "--workers", "2", "--servers", "1", "--",
         sys.executable, str(ROOT / "tests" / "trainer" / "scripts" / "fit_in_job.py"),
         str(tmp_path)],
        capture_output=True, text=True, timeout=110, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
               if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == [0, 1] and {r["size"] for r in results} == {2}
    # Metrics are averaged over ranks, so every rank reports the same numbers (timings are
    # each rank's own).
    local = ("samples_per_s", "epoch_time")
    same = [[{k: v for k, v in last.items() if k not in local} for last in r["last"]]
            for r in results]
    assert same[0] == same[1] and len(same[0]) == 2
    assert results[0]["last"][0]["val_accuracy"] > 0.8
    # Rank 0 named the run folders (one per fit) and wrote the checkpoints.
    assert (tmp_path / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "version_1" / "config.yaml").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["version_0", "version_1"]
    # 256 samples / 2 ranks / 32 per batch = 4 batches per epoch; 2 passes per step.
    assert [r["steps"] for r in results] == [[8, 2], [8, 2]]
    # validate/test in the job: the same exact mean on both ranks, equal to one process's.
    for r in results:
        assert r["validated"] == results[0]["validated"]
        assert r["validated"]["val_loss"] == pytest.approx(r["full_loss"], rel=1e-5)
        assert r["tested"]["test_loss"] == pytest.approx(r["full_loss"], rel=1e-5)
    assert sorted(r["predicted"] for r in results) == [127, 128]  # each rank its own shard


@pytest.mark.timeout(240)
def test_keras_precision_clipping_and_evaluation_in_a_launched_job(tmp_path):
    pytest.importorskip("keras")
    proc = subprocess.run(
        [sys.executable, "-m", "bpstrain.launch", "--workers", "2", "--servers", "1", "--",
         sys.executable, str(ROOT / "tests" / "trainer" / "scripts" / "keras_in_job.py"),
         str(tmp_path)],
        capture_output=True, text=True, timeout=230, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
               if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == [0, 1] and {r["size"] for r in results} == {2}
    # The loss scale's inf check sits inside the averaging: both ranks took the same steps.
    assert all(r["loss_scaled_inside"] and r["clip"] == 1.0 for r in results)
    assert results[0]["weights"] == results[1]["weights"]
    assert results[0]["last"]["val_accuracy"] > 0.8
    for r in results:
        assert r["validated"] == results[0]["validated"]
        assert r["validated"]["val_loss"] == pytest.approx(r["full"]["loss"], rel=1e-5)
        assert r["tested"]["test_accuracy"] == pytest.approx(r["full"]["accuracy"], rel=1e-6)
    assert sorted(r["predicted"] for r in results) == [127, 128]  # each rank its own shard
