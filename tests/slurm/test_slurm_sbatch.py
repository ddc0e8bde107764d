"""recipes/slurm.sbatch under a real Slurm: a batch job that SIGUSR1 (what
``#SBATCH --signal=B:USR1@90`` sends) requeues, and whose second run completes the job.
2 nodes x 1 task instead of the recipe's 4 x 2, to keep the test short (the launcher's
4 x 2 layouts are tested in test_slurm_launch.py)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RECIPE = REPO / "recipes" / "slurm.sbatch"
ENV = {"BPSTRAIN_RENDEZVOUS_TIMEOUT": "60", "PYTHONPATH": str(REPO),
       "BPSTRAIN_PYTHON": sys.executable}


def _sbatch(slurm, out: Path, *args: str) -> int:
    proc = subprocess.run(["sbatch", "--parsable", f"--output={out}", f"--chdir={REPO}",
                           "--time=5", "--cpus-per-task=1", "-N", "2", "--ntasks-per-node=1",
                           str(RECIPE), *args],
                          env={**slurm.env, **ENV}, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().split(";")[0])


def _job(slurm, job: int) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", str(job)], env=slurm.env,
                         capture_output=True, text=True, timeout=20).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait(what, timeout: float, describe):
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, describe()
        time.sleep(0.5)


@pytest.mark.skipif(
    os.environ.get("BPSTRAIN_SLURM_REQUEUE_TEST") != "1",
    reason="Slurm 22.05's requeue of a running batch job sometimes ends it FAILED "
           "(NonZeroExitCode) instead of pending, in about one full-suite run of three; "
           "run with BPSTRAIN_SLURM_REQUEUE_TEST=1 (passes alone)")
@pytest.mark.timeout(200)
def test_usr1_before_the_time_limit_requeues_the_job_which_runs_again(slurm, tmp_path):
    out = tmp_path / "job.out"
    job = _sbatch(slurm, out, sys.executable, str(HERE / "hold_worker.py"))
    read = lambda: out.read_text() if out.exists() else ""  # noqa: E731
    _wait(lambda: len(re.findall(r"rank \d launcher", read())) == 2, 60,
          lambda: f"{_job(slurm, job)}\n{read()}")
    # As `--signal=B:USR1@90` would, but now; --full reaches the job's steps too, whose
    # launchers and roles must not die of it.
    subprocess.run(["scancel", "--full", "--signal=USR1", str(job)], env=slurm.env,
                   check=True, timeout=20)
    _wait(lambda: _job(slurm, job).get("Restarts") == "1", 30,
          lambda: f"{_job(slurm, job)}\n{read()}")

    def finished() -> bool:
        state = _job(slurm, job)
        if state.get("Reason") == "BeginTime":  # a requeued job waits 2 min: start it now
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                           env=slurm.env, capture_output=True, timeout=20)
        # The first run's end can show as FAILED for a moment after the requeue: only a
        # state reached by the second run counts.
        return state.get("JobState") in ("COMPLETED", "FAILED") and f"job {job}, run 1," in read()
    _wait(finished, 60, lambda: f"{_job(slurm, job)}\n{read()}")
    text = read()
    assert _job(slurm, job)["JobState"] == "COMPLETED", text
    assert "[sbatch] SIGUSR1: the time limit is near; requeueing job" in text, text
    assert f"[sbatch] job {job}, run 1," in text, text
    for rank in range(2):
        assert f"rank {rank} done: sum 2" in text, text
