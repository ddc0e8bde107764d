"""Trainer.fit inside ``python -m bpstrain.launch`` (DMLC_ROLE=worker): one rank of the job."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.helpers import blobs
from tests.result_lines import read_results

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
    results = read_results(proc.stdout)
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
    results = read_results(proc.stdout)
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


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["kill", "scale-up"])
def test_fit_lets_a_restarted_or_added_worker_join_with_the_others_state(tmp_path, mode):
    """comm.fault_tolerance: a worker joins a running Trainer job at an optimizer step's
    end, in the place of one that was killed (the launcher's --max-restarts) or as a new
    rank (scale-up). It gets the weights, the optimizer's state, the epoch, the step and
    the sampler's position from the others; all three finish every epoch with weights
    equal bit for bit, and every sample of each epoch was trained."""
    workers = 3 if mode == "kill" else 2
    launcher = ["--max-restarts", "1"] if mode == "kill" else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "BPSTRAIN_TIMEOUT": "3",
           "BPSTRAIN_FAULT_TOLERANCE": "1", "BPSTRAIN_MAX_WORKERS": "3", "BPSTRAIN_OP_TIMEOUT": "60"}
    proc = subprocess.run(
        [sys.executable, "-m", "bpstrain.launch", "--workers", str(workers), "--servers", "1", *launcher, "--",
         sys.executable, str(ROOT / "tests" / "trainer" / "scripts" / "fit_joins_in_job.py"), str(tmp_path), mode],
        capture_output=True, text=True, timeout=230, cwd=ROOT, env=env)
    out = (proc.stdout + proc.stderr)[-5000:]
    assert proc.returncode == 0, out
    results = sorted(read_results(proc.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2], out
    joiner = results[2]
    assert joiner["admitted_late"] and joiner["restarted"] == ("1" if mode == "kill" else None), joiner
    for r in results:
        assert r["size"] == 3 and r["epochs"] == [0, 1, 2] and r["steps"] == results[0]["steps"], r
        assert r["weights"] == results[0]["weights"], out  # the joiner too, bit for bit
        assert r["loss"] == results[0]["loss"]  # the same history (the joiner's was sent)
    assert results[0]["loss"][-1] < results[0]["loss"][0]
    assert "worker(s) [2] joined the job at epoch" in proc.stdout + proc.stderr, out
    # Every sample of each epoch trained by someone (the victim's trained batches count).
    x, _ = blobs(384)
    index = {(f"{a:.5f}", f"{b:.5f}"): i for i, (a, b) in enumerate(x[:, :2])}
    for epoch in (0, 1, 2):
        trained = {index[tuple(line.split()[1:])] for f in (tmp_path / "seen").iterdir()
                   for line in f.read_text().splitlines() if line.split()[0] == str(epoch)}
        assert trained == set(range(len(x))), (epoch, sorted(set(range(len(x))) - trained))
