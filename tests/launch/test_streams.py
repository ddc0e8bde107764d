"""The launcher keeps each child's stdout and stderr apart, and a stop it decides on
prints one line naming the cause, not the stopped children's complaints."""

import io
import queue
import subprocess
import sys

import pytest
from launch_helpers import REPO, subprocess_env

from bpstrain.launch._procs import Child, supervise

_BOTH = "import sys; print('to stdout', flush=True); print('to stderr', file=sys.stderr)"
# Blocks until SIGTERM, then complains the way a scheduler does when its peers vanish.
_COMPLAINS_ON_TERM = (
    "import signal, sys, time\n"
    "def bye(*_):\n"
    "    print('worker 0 closed its connection; the job cannot continue', file=sys.stderr,"
    " flush=True)\n"
    "    sys.exit(1)\n"
    "signal.signal(signal.SIGTERM, bye)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n")


@pytest.mark.timeout(30)
def test_child_relays_stdout_and_stderr_to_separate_streams():
    out, err = io.StringIO(), io.StringIO()
    child = Child("worker 0", [sys.executable, "-c", _BOTH], subprocess_env(),
                  output=out, errors=err)
    assert child.wait(20)
    child.join_output()
    assert out.getvalue() == "[worker 0] to stdout\n"
    assert err.getvalue() == "[worker 0] to stderr\n"
    merged = io.StringIO()  # output= alone captures both (what the tests' jobs rely on)
    child = Child("worker 0", [sys.executable, "-c", _BOTH], subprocess_env(), output=merged)
    assert child.wait(20)
    child.join_output()
    assert sorted(merged.getvalue().splitlines()) == ["[worker 0] to stderr",
                                                      "[worker 0] to stdout"]


@pytest.mark.timeout(60)
def test_launcher_cli_keeps_worker_stderr_out_of_stdout():
    proc = subprocess.run(
        # The worker never joins the engine, so the services are stopped after 1 s.
        [sys.executable, "-m", "bpstrain.launch", "--workers", "1", "--servers", "1",
         "--service-timeout", "1", "--",
         sys.executable, "-c", _BOTH], cwd=REPO, env=subprocess_env(), capture_output=True,
        text=True, timeout=50)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[worker 0] to stdout" in proc.stdout and "to stderr" not in proc.stdout
    assert "[worker 0] to stderr" in proc.stderr


@pytest.mark.timeout(60)
def test_a_failure_stops_the_rest_with_one_line_and_no_wrong_blame(capsys):
    events = queue.Queue()
    out = io.StringIO()
    victim = Child("scheduler", [sys.executable, "-c", _COMPLAINS_ON_TERM], subprocess_env(),
                   events.put, output=out)
    while "ready" not in out.getvalue():  # it has installed its SIGTERM handler
        assert victim.exited.wait(0.05) is False
    failing = Child("worker 1", [sys.executable, "-c", "import sys; sys.exit(3)"],
                    subprocess_env(), events.put, output=out)
    assert supervise([failing], [victim], events, grace=5.0) == 3
    assert victim.returncode == 1  # it did run its complaint ...
    assert "closed its connection" not in out.getvalue()  # ... which was not relayed
    log = capsys.readouterr().err
    assert log.splitlines() == ["[launch] worker 1 exited with code 3; stopping the other 1 "
                                "process(es)"]
