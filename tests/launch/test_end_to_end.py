"""The launcher with the real scheduler/server roles and the C++ engine."""

import io
import subprocess
import sys
import time

import pytest
from launch_helpers import HERE, LAUNCH, REPO, alive, run_hand_started_job, subprocess_env

from bpstrain.launch import LocalJob, free_port

pytest.importorskip("bpstrain._core", reason="bpstrain's C++ extension is not built")

WORKER = [sys.executable, str(HERE / "e2e_worker.py")]


@pytest.mark.timeout(120)
def test_two_workers_one_server_sum_through_the_launcher():
    proc = subprocess.run([*LAUNCH, "--workers", "2", "--servers", "1", "--", *WORKER],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc
    lines = proc.stdout.splitlines()
    assert "[worker 0] rank 0 of 2: sum 3 expected 3" in lines, proc
    assert "[worker 1] rank 1 of 2: sum 3 expected 3" in lines, proc


@pytest.mark.timeout(120)
def test_init_again_after_shutdown_in_a_launched_job():
    """Horovod's init() / shutdown() / init(): the launcher's roles serve the next job."""
    proc = subprocess.run([*LAUNCH, "--workers", "2", "--servers", "1", "--", *WORKER],
                          cwd=REPO, env=subprocess_env(E2E_JOBS="3"), capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc
    lines = proc.stdout.splitlines()
    for rank in (0, 1):
        for job in (1, 2):
            assert f"[worker {rank}] job {job}: rank {rank} of 2: sum 3 expected 3" in lines, proc


@pytest.mark.timeout(120)
def test_real_job_with_a_failing_worker_is_torn_down():
    out = io.StringIO()
    job = LocalJob(WORKER, workers=2, servers=1, env=subprocess_env(E2E_FAIL_RANK="1"),
                   output=out, grace=3.0)
    assert job.run() == 9, out.getvalue()
    assert "[worker 1] failing on purpose" in out.getvalue()
    pids = [c.pid for c in (*job.workers, *job.services.children)]
    assert not [p for p in pids if alive(p)]


def _hand_started_job(worker_env: dict, worker_ids=("0", "1"), codes=None) -> list[str]:
    """Runs a hand-started job of e2e workers (the scheduler and server are told nothing
    of ``worker_env``) and returns each process's output (all must exit 0, or with
    ``codes``, one per process)."""
    common = subprocess_env(DMLC_NUM_WORKER=str(len(worker_ids)), DMLC_NUM_SERVER="1",
                            DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()))
    returncodes, outputs = run_hand_started_job(common, WORKER, worker_ids, worker_env)
    assert returncodes == (codes or [0] * len(returncodes)), outputs
    return outputs


@pytest.mark.timeout(120)
def test_a_worker_stopped_by_an_exception_fails_the_others_at_once_naming_it():
    """Its goodbye carries the exception: no wait for op_timeout, no blame on others."""
    start = time.monotonic()
    scheduler, server, rank0, rank1 = _hand_started_job(
        {"BYTEPS_LOCAL_SIZE": "1", "E2E_RAISE_RANK": "1", "BPSTRAIN_OP_TIMEOUT": "300"},
        codes=[1, 1, 1, 1])  # the job failed: every process says so
    assert time.monotonic() - start < 60  # far below the 300 s op timeout
    assert "ZeroDivisionError: bad batch" in rank1
    cause = "worker 1 (pid "
    for out in (scheduler, server, rank0):
        assert "stopped: ZeroDivisionError: bad batch; the job cannot continue" in out, out
        assert cause in out and "closed its connection" not in out, out
    assert "PeerError" in rank0


@pytest.mark.timeout(120)
def test_hand_started_byteps_style_job():
    """Scheduler, server and workers each started with DMLC_* variables, as with BytePS."""
    outputs = _hand_started_job({"BYTEPS_LOCAL_SIZE": "1"})
    assert "rank 0 of 2: sum 3 expected 3" in outputs[2]
    assert "rank 1 of 2: sum 3 expected 3" in outputs[3]


@pytest.mark.timeout(120)
def test_hand_started_job_of_two_hosts_with_two_processes_each():
    """BytePS's rank rules: DMLC_NUM_WORKER=2 hosts, BYTEPS_LOCAL_SIZE=2 on each: size 4.

    The scheduler and server are told nothing about the local size (as in BytePS); the
    scheduler learns it from the workers. Each host's processes come from one
    ``DMLC_ROLE=worker python -m bpstrain.launch`` (bpslaunch's job).
    """
    host0, host1 = _hand_started_job({"BYTEPS_LOCAL_SIZE": "2"})[2:]
    assert "[worker 0] rank 0 of 4: sum 10 expected 10" in host0
    assert "[worker 1] rank 1 of 4: sum 10 expected 10" in host0
    assert "[worker 2] rank 2 of 4: sum 10 expected 10" in host1
    assert "[worker 3] rank 3 of 4: sum 10 expected 10" in host1


PARENT = """
import os, signal, socket, time
from bpstrain.launch import LocalServices
services = LocalServices(workers=1, servers=1).start()
print(*[c.pid for c in services.children], flush=True)
while True:  # The scheduler listens only after it armed PR_SET_PDEATHSIG.
    try:
        socket.create_connection(("127.0.0.1", services.port)).close()
        break
    except OSError:
        time.sleep(0.02)
os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no cleanup: only PR_SET_PDEATHSIG is left
"""


@pytest.mark.timeout(60)
def test_services_die_with_a_killed_parent():
    proc = subprocess.run([sys.executable, "-c", PARENT], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == -9, proc
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2, proc
    deadline = time.monotonic() + 20
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)  # They die asynchronously after the parent; nothing to wait on.
    assert not [p for p in pids if alive(p)]
