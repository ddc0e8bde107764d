"""Real multi-process jobs: launcher, roles started by hand, dead peers, bad env."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bpstrain.launch import free_port

SCRIPTS = Path(__file__).parent / "scripts"
PY = sys.executable


def launch(workers, servers, script, env=None, timeout=90):
    return subprocess.run(
        [PY, "-m", "bpstrain.launch", "--workers", str(workers), "--servers", str(servers), "--",
         PY, str(SCRIPTS / script)],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers,servers", [(1, 1), (2, 1), (3, 2)])
def test_every_dtype_on_a_real_job(workers, servers):
    r = launch(workers, servers, "check_dtypes.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("DTYPES_OK") == workers


@pytest.mark.timeout(120)
def test_killed_worker_makes_the_launcher_exit_nonzero():
    start = time.time()
    r = launch(3, 1, "die_midjob.py", env={"DIE_RANK": "1"})
    assert r.returncode != 0, r.stdout + r.stderr
    assert "worker 1" in r.stdout + r.stderr
    assert time.time() - start < 60


def role_env(role, port, workers, servers, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(DMLC_ROLE=role, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port),
               DMLC_NUM_WORKER=str(workers), DMLC_NUM_SERVER=str(servers), PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start_by_hand(workers, servers, script, **extra):
    """BytePS-style: every role started separately, workers through bpslaunch-like mode."""
    port = free_port()
    procs = {"scheduler": subprocess.Popen([PY, "-m", "bpstrain.launch"],
                                           env=role_env("scheduler", port, workers, servers, **extra),
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)}
    for i in range(servers):
        procs[f"server{i}"] = subprocess.Popen(
            [PY, "-m", "bpstrain.launch"], env=role_env("server", port, workers, servers, **extra),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for i in range(workers):
        procs[f"worker{i}"] = subprocess.Popen(
            [PY, "-m", "bpstrain.launch", PY, str(SCRIPTS / script)],
            env=role_env("worker", port, workers, servers, DMLC_WORKER_ID=i, **extra),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return procs


def finish(procs, timeout=60):
    outs = {}
    for name, p in procs.items():
        try:
            outs[name] = (p.wait(timeout=timeout), p.stdout.read())
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            raise
    return outs


@pytest.mark.timeout(120)
def test_hand_started_roles_form_one_job_and_exit_by_themselves():
    outs = finish(start_by_hand(2, 2, "check_dtypes.py"))
    for name, (code, out) in outs.items():
        assert code == 0, f"{name}: {out}"
    assert sum(out.count("DTYPES_OK") for _, out in outs.values()) == 2


@pytest.mark.timeout(120)
def test_killed_worker_turns_into_errors_on_every_survivor():
    outs = finish(start_by_hand(3, 1, "die_midjob.py", DIE_RANK=1, BPSTRAIN_TIMEOUT=20), timeout=45)
    for name in ("worker0", "worker2"):
        code, out = outs[name]
        assert code == 17 and "PEER_ERROR" in out and "worker 1" in out, f"{name}: {out}"
        seconds = float(out.split("PEER_ERROR ")[1].split()[0])
        assert seconds < 30, out
    assert outs["scheduler"][0] != 0 and outs["server0"][0] != 0


@pytest.mark.timeout(120)
def test_killed_server_turns_into_errors_everywhere():
    procs = start_by_hand(2, 1, "die_midjob.py", BPSTRAIN_TIMEOUT=20)
    try:
        w0 = procs["worker0"]
        assert w0.stdout.readline().strip() == "READY"
        time.sleep(0.5)
        procs["server0"].send_signal(signal.SIGKILL)
        outs = finish(procs, timeout=45)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for name in ("worker0", "worker1"):
        code, out = outs[name]
        assert code == 17 and "PEER_ERROR" in out, f"{name}: {out}"
    assert outs["scheduler"][0] != 0, outs["scheduler"][1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "env,needle",
    [
        ({"DMLC_ROLE": "server", "DMLC_NUM_WORKER": "two", "DMLC_PS_ROOT_PORT": "9"}, "DMLC_NUM_WORKER"),
        ({"DMLC_ROLE": "scheduler", "DMLC_NUM_WORKER": "1"}, "DMLC_PS_ROOT_PORT"),
        ({"DMLC_ROLE": "sheduler", "DMLC_PS_ROOT_PORT": "9"}, "DMLC_ROLE"),
        ({"DMLC_ROLE": "server", "DMLC_PS_ROOT_PORT": "99999"}, "DMLC_PS_ROOT_PORT"),
    ],
)
def test_malformed_environment_names_the_variable(env, needle):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    r = subprocess.run([PY, "-m", "bpstrain.launch"], env={**base, **env}, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.timeout(90)
def test_hung_worker_is_detected_by_heartbeat_timeout():
    procs = start_by_hand(2, 1, "die_midjob.py", BPSTRAIN_TIMEOUT=3)
    try:
        assert procs["worker1"].stdout.readline().strip() == "READY"
        time.sleep(0.3)
        procs["worker1"].send_signal(signal.SIGSTOP)  # alive but silent
        code = procs["worker0"].wait(timeout=30)
        out = procs["worker0"].stdout.read()
        assert code == 17 and "PEER_ERROR" in out and "heartbeat" in out, out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.timeout(60)
def test_ctrl_c_interrupts_a_blocking_wait():
    procs = start_by_hand(2, 1, "interrupt_wait.py")
    try:
        w0 = procs["worker0"]
        assert w0.stdout.readline().strip() == "BLOCKING"
        time.sleep(0.5)
        sent = time.time()
        w0.send_signal(signal.SIGINT)
        assert w0.wait(timeout=10) == 0
        assert time.time() - sent < 5  # the wait gives the GIL back every 0.1 s
        assert "INTERRUPTED" in w0.stdout.read()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
