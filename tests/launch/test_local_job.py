"""LocalJob / LocalServices process management, with fake scheduler/server roles."""

import io
import re
import threading
import time

import pytest
from launch_helpers import FAKE_ROLE, FAKE_WORKER, assert_all_gone, pids_in, subprocess_env

from bpstrain.errors import ConfigError, PeerError
from bpstrain.launch import LocalJob, LocalServices, launch_local
from bpstrain.launch._procs import Child, stop_children


@pytest.fixture(autouse=True)
def fake_roles(monkeypatch):
    monkeypatch.setattr(LocalServices, "role_cmd", FAKE_ROLE)


def run_job(workers=2, servers=1, local_size=None, max_restarts=0, **env):
    out = io.StringIO()
    code = launch_local(FAKE_WORKER, workers, servers, local_size, env=subprocess_env(**env),
                        output=out, grace=2.0, service_timeout=10.0, max_restarts=max_restarts)
    return code, out.getvalue()


@pytest.mark.timeout(60)
def test_with_fault_tolerance_a_failed_worker_is_restarted_max_restarts_times(capfd):
    # Rank 1 fails in every life: started again twice (BPSTRAIN_RESTART=1, 2), then the
    # job goes on without it and ends well when rank 0 finishes.
    code, out = run_job(max_restarts=2, FAKE_FAIL_RANK="1", FAKE_LINGER="4", BPSTRAIN_FAULT_TOLERANCE="1")
    assert code == 0, out
    assert out.count("[worker 1] rank=1 ") == 3 and out.count("[worker 0] rank=0 ") == 1, out
    assert "[worker 1] restart=1" in out and "[worker 1] restart=2" in out and "restart=3" not in out, out
    err = capfd.readouterr().err
    assert err.count("fault tolerance: restarted it") == 2 and "the job goes on with the other workers" in err, err


@pytest.mark.timeout(60)
def test_without_fault_tolerance_max_restarts_restarts_nothing(capfd):
    code, out = run_job(max_restarts=2, FAKE_FAIL_RANK="1", FAKE_FAIL_CODE="3")
    assert code == 3 and out.count("[worker 1] rank=1 ") == 1, out
    assert "--max-restarts needs comm.fault_tolerance" in capfd.readouterr().err


@pytest.mark.timeout(60)
def test_success_prefixes_every_line_and_services_are_stopped_after_the_workers():
    code, out = run_job(workers=2, servers=2)
    assert code == 0, out
    lines = out.splitlines()
    assert all(re.match(r"\[(scheduler|server [01]|worker [01])\] ", ln) for ln in lines), out
    for rank in (0, 1):
        assert f"[worker {rank}] rank={rank} " in out
        assert f"[worker {rank}] second line" in lines
        # A last line without "\n" still comes out whole, on its own line.
        assert f"[worker {rank}] no newline at the end" in lines
    # The launcher's services serve job after job (BPSTRAIN_SERVE_NEXT_JOB): they are
    # stopped once the workers exited, whether or not they finished on their own.
    assert "[scheduler] scheduler ready" in out and "[server 1] server ready" in out
    assert_all_gone(pids_in(out))


@pytest.mark.timeout(60)
def test_local_size_maps_ranks_to_worker_id_and_local_rank():
    # BytePS's rule: DMLC_NUM_WORKER counts the 2 hosts of 2 processes. Fewer dedicated
    # servers (1) than hosts (2): mixed mode adds a server on each host, 3 in all.
    code, out = run_job(workers=4, local_size=2)
    assert code == 0, out
    for rank in range(4):
        expected = (f"[worker {rank}] rank={rank} worker_id={rank // 2} local_rank={rank % 2} "
                    "local_size=2 num_worker=2 num_server=3 ")
        assert expected in out
    assert re.search(r"\[server 0\] server ready pid=\d+ host_id=-", out), out
    for s, host in ((1, 0), (2, 1)):
        assert re.search(rf"\[server {s}\] server ready pid=\d+ host_id=local-host-{host}\b",
                         out), out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mixed, servers, expected", [(False, 1, 1), (True, 0, 2), (None, 2, 2)])
def test_mixed_mode_choice_of_a_local_job(mixed, servers, expected):
    out = io.StringIO()
    code = launch_local(FAKE_WORKER, 4, servers, 2, env=subprocess_env(), output=out,
                        grace=2.0, service_timeout=10.0, mixed=mixed)
    assert code == 0, out.getvalue()
    assert f"num_worker=2 num_server={expected} " in out.getvalue()


@pytest.mark.timeout(60)
def test_failing_worker_stops_everyone_including_grandchildren():
    start = time.monotonic()
    code, out = run_job(workers=3, FAKE_FAIL_RANK="1", FAKE_FAIL_CODE="7", FAKE_BLOCK="1",
                        FAKE_GRANDCHILD="1")
    assert code == 7, out
    assert "[worker 1] failing on purpose" in out
    pids = pids_in(out)
    assert len(pids) >= 2 + 2  # scheduler + server, and at least one worker ...
    assert_all_gone(pids)
    assert time.monotonic() - start < 15  # SIGTERM worked; no waiting on timeouts.


@pytest.mark.timeout(60)
def test_dead_service_fails_the_job():
    code, out = run_job(workers=2, FAKE_ROLE_FAIL="server", FAKE_BLOCK="1")
    assert code == 3, out
    assert "[server 0] server failing on purpose" in out
    assert_all_gone(pids_in(out))


class _Watch(io.StringIO):
    """Output stream that sets ``seen`` once ``text`` has been written."""

    def __init__(self, text):
        super().__init__()
        self.text, self.seen = text, threading.Event()

    def write(self, s):
        n = super().write(s)
        if self.text in s:
            self.seen.set()
        return n


@pytest.mark.timeout(60)
def test_child_ignoring_sigterm_is_killed_after_grace():
    out = _Watch("blocking")
    env = subprocess_env(DMLC_WORKER_ID="0", BYTEPS_LOCAL_RANK="0", BYTEPS_LOCAL_SIZE="1",
                         DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1", FAKE_BLOCK="1",
                         FAKE_IGNORE_TERM="1", FAKE_GRANDCHILD="1")
    child = Child("worker 0", FAKE_WORKER, env, output=out)
    assert out.seen.wait(30), out.getvalue()
    start = time.monotonic()
    stop_children([child], grace=0.5)
    assert 0.5 <= time.monotonic() - start < 10
    assert child.returncode == -9  # SIGKILL
    assert_all_gone(pids_in(out.getvalue()))


@pytest.mark.timeout(60)
def test_services_still_running_after_workers_are_stopped_without_failing():
    out = io.StringIO()
    job = LocalJob(FAKE_WORKER, workers=1, env=subprocess_env(FAKE_ROLE_STUCK="1"),
                   output=out, grace=2.0, service_timeout=0.2)
    assert job.run() == 0
    assert all(c.returncode is not None for c in job.services.children)
    assert_all_gone(pids_in(out.getvalue()))


@pytest.mark.timeout(60)
def test_missing_worker_command_gives_127_and_stops_services():
    job = LocalJob(["/nonexistent/train"], workers=1, env=subprocess_env(), output=io.StringIO())
    assert job.run() == 127
    assert all(c.returncode is not None for c in job.services.children)


@pytest.mark.timeout(60)
def test_local_services_env_check_and_stop():
    out = io.StringIO()
    # BYTEPS_LOCAL_RANK from an enclosing job must not leak into the new one.
    base = subprocess_env(FAKE_ROLE_STUCK="1", BYTEPS_LOCAL_RANK="5")
    with LocalServices(workers=4, servers=2, local_size=2, env=base, output=out,
                       grace=2.0) as services:
        env = services.worker_env(3)
        assert {k: env[k] for k in ("DMLC_ROLE", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER",
                                    "DMLC_WORKER_ID", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE")} \
            == {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "2",
                "DMLC_WORKER_ID": "1", "BYTEPS_LOCAL_RANK": "1", "BYTEPS_LOCAL_SIZE": "2"}
        assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1"
        assert env["DMLC_PS_ROOT_PORT"] == str(services.port)
        assert env["PYTHONUNBUFFERED"] == "1"
        services.check()  # all alive
        assert [c.label for c in services.children] == ["scheduler", "server 0", "server 1"]
        services.children[1].signal_group(9)
        services.children[1].exited.wait(10)
        with pytest.raises(PeerError, match=r"server 0 of the local cluster exited with code 137"):
            services.check()
    assert services.wait(0)
    services.stop()  # idempotent
    assert_all_gone([c.pid for c in services.children])


def test_bad_layout_and_index_are_config_errors():  # ConfigError is a ValueError
    with pytest.raises(ValueError, match=r"Received: workers=3, local_size=2"):
        LocalServices(workers=3, local_size=2)
    with pytest.raises(ConfigError, match=r"servers must be a positive integer\. "
                       r"Received: servers=0"):
        LocalServices(workers=1, servers=0)
    with pytest.raises(ValueError, match=r"Received: i=2"):
        LocalServices(workers=2, port=1234).worker_env(2)
    with pytest.raises(RuntimeError, match="not started"):
        LocalServices(workers=2).worker_env(0)
