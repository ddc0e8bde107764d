"""``python -m bpstrain.launch``: arguments, env roles, exit codes and signals."""

import re
import signal
import subprocess
import sys
import types

import pytest
from launch_helpers import (FAKE_WORKER, LAUNCH_WITH_FAKE_ROLES, REPO, assert_all_gone,
                            pids_in, subprocess_env)

from bpstrain.errors import BpsError, ConfigError
from bpstrain.launch._cli import main
from bpstrain.launch._join import read_join_file, remove_join_file, write_join_file

BAD_ARGS = [
    (["--workers", "x", "--", "true"], {}, r"--workers: expected an integer >= 1\. "
     r"Received: --workers='x'"),
    (["--workers", "0", "--", "true"], {}, r"Received: --workers='0'"),
    (["--workers", "2", "--port", "70000", "--", "true"], {},
     r"expected an integer in \[1, 65535\]\. Received: --port='70000'"),
    (["--workers", "3", "--local-size", "2", "--", "true"], {},
     r"--workers must be a multiple of --local-size .*Received: --workers=3, --local-size=2"),
    (["--workers", "2", "--max-restarts", "-1", "--", "true"], {}, r"Received: --max-restarts='-1'"),
    (["--slurm", "--max-restarts", "1", "--", "true"], {}, r"--max-restarts does not apply with --slurm"),
    (["--workers", "2"], {}, r"no worker command given; put it after `--`.*Received: CMD=\[\]"),
    (["--workers", "2", "--", "/nonexistent/train"], {},
     r"'/nonexistent/train' is not an executable.*Received: CMD=\['/nonexistent/train'\]"),
    (["--servers", "2", "--", "true"], {}, r"--servers only applies with --workers N"),
    ([], {}, r"set DMLC_ROLE to scheduler, server or worker\. Received: argv=\[\], "
     r"DMLC_ROLE unset"),
    (["true"], {"DMLC_ROLE": "boss"}, r"DMLC_ROLE must be one of scheduler, server, worker\. "
     r"Received: DMLC_ROLE='boss'"),
    ([], {"DMLC_ROLE": "worker"}, r"DMLC_ROLE=worker needs the worker command"),
    (["true"], {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_WORKER": "two"},
     r"DMLC_NUM_WORKER must be an integer >= 1\. Received: DMLC_NUM_WORKER='two'"),
    (["--join", "/nonexistent/join.json"], {}, r"no join file at '/nonexistent/join.json': the job is over"),
    (["--join", "/etc/hostname"], {}, r"cannot read the join file '/etc/hostname'"),
    (["--join", "j.json", "--workers", "2", "--", "true"], {}, r"--workers does not apply with --join"),
]


@pytest.mark.parametrize("argv, environ, message", BAD_ARGS)
def test_bad_arguments_and_env_exit_2_with_a_clear_message(argv, environ, message, capsys):
    environ = {"PATH": "/usr/bin:/bin", **environ}
    try:
        code = main(argv, environ)
    except SystemExit as exc:  # argparse reports bad flag values itself.
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "usage: python -m bpstrain.launch" in err
    assert re.search(message, err), err


@pytest.mark.parametrize("raised, code, message", [
    (None, 0, ""),
    (BpsError("worker 1 stopped answering"), 1, "server failed: worker 1 stopped answering"),
    (ConfigError("DMLC_PS_ROOT_PORT must be an integer. Received: 'x'"), 2, "Received: 'x'"),
])
def test_role_mode_runs_run_role_and_maps_errors(raised, code, message, monkeypatch, capsys):
    calls = []

    def run_role(role, environ=None):
        calls.append((role, environ["DMLC_ROLE"]))
        if raised is not None:
            raise raised

    monkeypatch.setitem(sys.modules, "bpstrain.roles", types.SimpleNamespace(run_role=run_role))
    # Extra arguments are ignored, as by bpslaunch on scheduler/server hosts.
    assert main(["python", "train.py"], {"DMLC_ROLE": "server"}) == code
    assert calls == [("server", "server")]
    assert message in capsys.readouterr().err


def launcher(args, **env):
    return subprocess.Popen([*LAUNCH_WITH_FAKE_ROLES, *args], cwd=REPO, env=subprocess_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(60)
def test_cli_prefixes_output_and_propagates_the_failing_exit_code():
    proc = launcher(["--workers", "2", "--servers", "1", "--grace", "2", "--", *FAKE_WORKER],
                    FAKE_FAIL_RANK="1", FAKE_FAIL_CODE="5", FAKE_BLOCK="1")
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 5, (out, err)
    assert "[worker 1] failing on purpose" in out.splitlines()
    assert "[launch] worker 1 exited with code 5; stopping the other" in err
    assert_all_gone(pids_in(out))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_launcher_leaves_no_process(sig):
    proc = launcher(["--workers", "2", "--servers", "1", "--", *FAKE_WORKER],
                    FAKE_BLOCK="1", FAKE_GRANDCHILD="1")
    try:
        seen = []
        while sum("grandchild=" in line for line in seen) < 4:  # scheduler, server, 2 workers
            line = proc.stdout.readline()
            assert line, f"launcher ended early: {seen} {proc.stderr.read()}"
            seen.append(line)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    assert proc.returncode == 128 + sig, err
    assert f"interrupted ({sig.name}); stopping all processes" in err
    assert_all_gone(pids_in("".join(seen) + out))


@pytest.mark.timeout(60)
def test_worker_role_spawns_local_ranks_like_bpslaunch(tmp_path):
    # DMLC_NUM_WORKER counts hosts (BytePS): 2 hosts x 2 local ranks, this is host 1.
    # Rank 3 fails only once rank 2 has printed, so the launcher's stop cannot cut it off.
    env = subprocess_env(DMLC_ROLE="worker", DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1",
                         DMLC_WORKER_ID="1", BYTEPS_LOCAL_SIZE="2", DMLC_PS_ROOT_URI="127.0.0.1",
                         DMLC_PS_ROOT_PORT="9", FAKE_BLOCK="1", FAKE_FAIL_RANK="3",
                         FAKE_FAIL_CODE="4", FAKE_SYNC_DIR=str(tmp_path), FAKE_SYNC_COUNT="2")
    proc = subprocess.run([sys.executable, "-m", "bpstrain.launch", *FAKE_WORKER], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 4, proc
    assert "[worker 2] rank=2 worker_id=1 local_rank=0 local_size=2" in proc.stdout
    assert "[worker 3] failing on purpose" in proc.stdout
    assert_all_gone(pids_in(proc.stdout))


@pytest.mark.timeout(60)
def test_worker_role_with_local_rank_execs_the_command_and_passes_its_exit_code():
    env = subprocess_env(DMLC_ROLE="worker", DMLC_NUM_WORKER="2", DMLC_WORKER_ID="1",
                         BYTEPS_LOCAL_RANK="0", DMLC_PS_ROOT_PORT="9", MARK="passed-through")
    code = "import os, sys; print(os.environ['MARK'], os.environ['DMLC_WORKER_ID']); sys.exit(6)"
    proc = subprocess.run([sys.executable, "-m", "bpstrain.launch", sys.executable, "-c", code],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 6, proc
    assert proc.stdout == "passed-through 1\n"  # exec: no prefix, same process


@pytest.mark.timeout(60)
def test_join_runs_the_jobs_command_as_a_worker_without_a_process_identity(tmp_path):
    # What a launched job with fault tolerance writes: the job, none of one process's identity.
    job_env = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9", "DMLC_NUM_WORKER": "2",
               "BPSTRAIN_SECRET": "s3cret", "BPSTRAIN_FAULT_TOLERANCE": "1", "DMLC_ROLE": "worker",
               "DMLC_WORKER_ID": "1", "BYTEPS_LOCAL_RANK": "1", "BPSTRAIN_HOST_ID": "h1", "PATH": "/usr/bin"}
    code = ("import os, sys; print(os.environ['DMLC_ROLE'], os.environ.get('DMLC_WORKER_ID'), "
            "os.environ['BPSTRAIN_SECRET'], os.environ['BYTEPS_LOCAL_RANK'], os.environ.get('BPSTRAIN_HOST_ID'), "
            "sys.argv[1:]); sys.exit(5)")
    path = write_join_file(job_env, [sys.executable, "-c", code, "job-command"])
    try:
        assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
        env, cmd = read_join_file(str(path))
        assert env == {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9", "DMLC_NUM_WORKER": "2",
                       "BPSTRAIN_SECRET": "s3cret", "BPSTRAIN_FAULT_TOLERANCE": "1", "BYTEPS_LOCAL_RANK": "0"}
        # The caller's own identity (a worker of the job starting another) is dropped too.
        caller = subprocess_env(DMLC_WORKER_ID="0", BPSTRAIN_HOST_ID="h0")
        run = [sys.executable, "-m", "bpstrain.launch", "--join", str(path)]
        proc = subprocess.run(run, cwd=REPO, env=caller, capture_output=True, text=True, timeout=50)
        assert proc.returncode == 5, proc
        assert proc.stdout == "worker None s3cret 0 None ['job-command']\n", proc
        own = subprocess.run(run + ["--", sys.executable, "-c", "print('own command')"], cwd=REPO, env=caller,
                             capture_output=True, text=True, timeout=50)
        assert own.returncode == 0 and own.stdout == "own command\n", own
        not_a_join_file = tmp_path / "other.json"
        not_a_join_file.write_text('{"env": {"X": 1}, "cmd": "python"}')
        with pytest.raises(ConfigError, match="is not a join file"):
            read_join_file(str(not_a_join_file))
    finally:
        remove_join_file(path)
    assert not path.parent.exists()
