"""Shared helpers for the launcher tests (paths, fake roles, leftover-process checks)."""

import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FAKE_ROLE = [sys.executable, str(HERE / "fake_role.py")]
FAKE_WORKER = [sys.executable, str(HERE / "fake_worker.py")]
LAUNCH_WITH_FAKE_ROLES = [sys.executable, str(HERE / "launch_fake_roles.py")]
LAUNCH = [sys.executable, "-m", "bpstrain.launch"]


def subprocess_env(**extra: str) -> dict:
    """os.environ with the repo importable and ``extra`` on top."""
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}
    for key in ("DMLC_ROLE", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE"):
        env.pop(key, None)
    env.update(extra)
    return env


def pids_in(text: str) -> list:
    """Every ``pid=N`` / ``grandchild=N`` the fake processes printed."""
    return [int(p) for p in re.findall(r"(?:pid|grandchild)=(\d+)", text)]


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie awaiting a non-reaping init counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def assert_all_gone(pids: list) -> None:
    """Fails naming every process from ``pids`` that is still running."""
    assert pids, "the fake processes printed no pids; the test is not checking anything"
    left = [p for p in pids if alive(p)]
    assert not left, f"processes left running: {left}"


def run_hand_started_job(common_env: dict, worker_cmd: list, worker_ids, worker_env: dict | None = None,
                         timeout: float = 90) -> tuple[list, list]:
    """Starts a job by hand as with BytePS: the scheduler, one server and, per id in
    ``worker_ids``, a ``DMLC_ROLE=worker python -m bpstrain.launch worker_cmd`` with that
    ``DMLC_WORKER_ID``; every process gets ``common_env`` (the job's DMLC_* variables),
    the workers ``worker_env`` on top. Waits for all (the workers first), kills any still
    running after ``timeout`` s, and returns their exit codes and outputs in the order
    scheduler, server, workers."""
    procs = []
    try:
        for role in ("scheduler", "server"):
            procs.append(subprocess.Popen(LAUNCH, cwd=REPO, env={**common_env, "DMLC_ROLE": role},
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for worker_id in worker_ids:
            env = {**common_env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(worker_id), **(worker_env or {})}
            procs.append(subprocess.Popen([*LAUNCH, *worker_cmd], cwd=REPO, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=timeout)[0] for p in reversed(procs)][::-1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outputs
