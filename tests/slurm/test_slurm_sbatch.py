"""recipes/slurm.sbatch under a real Slurm: SIGUSR1 to the step (what
``#SBATCH --signal=USR1@90`` sends) makes the Trainer checkpoint mid-epoch and requeue the
job, whose second run resumes at the next batch and completes it. 2 nodes x 1 task instead
of the recipe's 4 x 2, to keep the test short (the launcher's 4 x 2 layouts are tested in
test_slurm_launch.py)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.result_lines import results_by_rank

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RECIPE = REPO / "recipes" / "slurm.sbatch"
FIT = REPO / "tests" / "trainer" / "scripts" / "preempt_fit.py"
ENV = {"BPSTRAIN_RENDEZVOUS_TIMEOUT": "60", "PYTHONPATH": str(REPO),
       "BPSTRAIN_PYTHON": sys.executable}


def _sbatch(slurm, out: Path, *args: str, **env: str) -> int:
    proc = subprocess.run(["sbatch", "--parsable", f"--output={out}", f"--chdir={REPO}",
                           "--time=5", "--cpus-per-task=1", "-N", "2", "--ntasks-per-node=1",
                           str(RECIPE), *args],
                          env={**slurm.env, **ENV, **env}, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().split(";")[0])


def _job(slurm, job: int) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", str(job)], env=slurm.env,
                         capture_output=True, text=True, timeout=20).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _run_processes(job: int) -> list:
    """Pids of the job's processes on this machine: its batch script, srun, tasks (their
    environment has SLURM_JOB_ID) and step daemons (``slurmstepd: [JOB.STEP]``)."""
    env_mark, title = f"SLURM_JOB_ID={job}\0".encode(), f"[{job}.".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read() + b"\0"
        except OSError:
            continue
        if env_mark in environ or (cmdline.startswith(b"slurmstepd") and title in cmdline):
            found.append(int(entry))
    return found


def _wait(what, timeout: float, describe):
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, describe()
        time.sleep(0.5)


@pytest.mark.timeout(300)
def test_usr1_checkpoints_requeues_and_the_next_run_resumes_at_the_next_batch(slurm, tmp_path):
    def submit(out: Path, args: list) -> int:
        return _sbatch(slurm, out, *args, PREEMPT_STEP_SLEEP="0.1")
    _requeued_job_resumes_exactly(slurm, tmp_path, submit)


@pytest.mark.timeout(300)
def test_the_trainer_under_a_bare_srun_in_a_batch_job_requeues_and_resumes_too(slurm, tmp_path):
    """No launcher: ``srun python train.py``, each task one rank (cluster.launcher auto)."""
    def submit(out: Path, args: list) -> int:
        script = tmp_path / "bare.sbatch"
        script.write_text("#!/bin/bash\n"
                          'echo "[sbatch] job $SLURM_JOB_ID, run ${SLURM_RESTART_COUNT:-0},"\n'
                          "srun " + " ".join(args) + "\n")
        proc = subprocess.run(
            ["sbatch", "--parsable", f"--output={out}", f"--chdir={REPO}", "--time=5",
             "--cpus-per-task=1", "-N", "2", "--ntasks-per-node=1", "--requeue",
             "--open-mode=append", "--signal=USR1@90", str(script)],
            env={**slurm.env, **ENV, "PREEMPT_STEP_SLEEP": "0.1"}, capture_output=True,
            text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.strip().split(";")[0])
    _requeued_job_resumes_exactly(slurm, tmp_path, submit)


def _requeued_job_resumes_exactly(slurm, tmp_path, submit):
    """Submits the 2-rank preempt_fit.py job, sends it SIGUSR1 mid-epoch, lets the requeued
    run finish, and compares both runs' step logs and weights with an uninterrupted run."""
    # What the job must reproduce: the same 2-rank fit, uninterrupted (local launcher).
    whole = subprocess.run(
        [sys.executable, "-m", "bpstrain.launch", "--workers", "2", "--servers", "1", "--",
         sys.executable, str(FIT), str(tmp_path / "whole"), str(tmp_path / "whole_log")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert whole.returncode == 0, whole.stdout + whole.stderr
    expected = results_by_rank(whole.stdout)
    logs = tmp_path / "log"
    lines = lambda r: (logs / f"rank{r}.log").read_text().splitlines() \
        if (logs / f"rank{r}.log").exists() else []  # noqa: E731

    out = tmp_path / "job.out"
    job = submit(out, [sys.executable, str(FIT), str(tmp_path / "run"), str(logs)])
    read = lambda: out.read_text() if out.exists() else ""  # noqa: E731
    _wait(lambda: len(lines(1)) >= 20, 90, lambda: f"{_job(slurm, job)}\n{read()}")
    # As `--signal=USR1@90` does at 90 s before the limit: every process of the steps.
    subprocess.run(["scancel", "--signal=USR1", str(job)], env=slurm.env, check=True,
                   timeout=20)
    _wait(lambda: _job(slurm, job).get("Restarts") == "1", 60,
          lambda: f"{_job(slurm, job)}\n{read()}")
    # Slurm holds a requeued job (BeginTime, ~2 min); the test starts it at once, but only
    # once the first run has ended completely (its batch script, srun, launchers, step
    # daemons), as it would have long before in those 2 minutes.
    _wait(lambda: not _run_processes(job), 60, lambda: f"{_run_processes(job)}\n{read()}")
    time.sleep(2)

    def finished() -> bool:
        state = _job(slurm, job)
        if state.get("Reason") == "BeginTime":  # a requeued job waits 2 min: start it now
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                           env=slurm.env, capture_output=True, timeout=20)
        return state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED") and \
            f"job {job}, run 1," in read() and "RESULT " in read()
    _wait(finished, 120, lambda: f"{_job(slurm, job)}\n{read()}\n{slurm.logs()}")
    text = read()
    assert _job(slurm, job)["JobState"] == "COMPLETED", f"{_job(slurm, job)}\n{text}"
    # Where the first run stopped, from its checkpoint (what it printed after the requeue
    # may be lost: Slurm ends every process of the run at once).
    import torch

    ckpt = tmp_path / "run" / "version_0" / "checkpoints" / f"preempt-{job}.ckpt"
    position = torch.load(ckpt, map_location="cpu", weights_only=False)["position"]
    step, batch = position["global_step"], position["batch"]
    assert 20 <= step < 48 and batch == step % 16, position
    # The second run found the job's checkpoint by itself (no trainer.resume) and went on
    # at the next batch: the step logs of both runs together are the uninterrupted one's
    # on every rank (a rank that stopped at another step would lose or repeat lines).
    assert "resumed from" in text and f"batch {batch})" in text, text
    got = results_by_rank(text)
    for rank in (0, 1):
        assert lines(rank) == (tmp_path / "whole_log" / f"rank{rank}.log").read_text(
            ).splitlines(), rank
        assert got[rank]["steps"] == 48 and got[rank]["weights"] == expected[rank]["weights"]
    assert got[0]["history"] == expected[0]["history"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["version_0"]
