"""Runs a worker script as a real job through ``python -m bpstrain.launch`` (test helper).

Shared by tests/keras and tests/tensorflow. Workers print ``CHECK {json}`` lines
(name, rank, ok, error) with :func:`report_checks`; :func:`launch` collects them.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def report_checks(checks, rank, size):
    """Worker side: runs every ``(name, check)`` as ``check(rank, size)``, one line each.

    A failing check is reported and the next one still runs.
    """
    for name, check in checks:
        try:
            check(rank, size)
            ok, error = True, ""
        except Exception as exc:  # reported per check; the next check still runs
            ok, error = False, f"{type(exc).__name__}: {exc}"[-3000:]
        print("CHECK " + json.dumps({"name": name, "rank": rank, "ok": ok, "error": error}),
              flush=True)


def launch(argv, workers, extra_env, timeout, launcher_args=()):
    """Runs the job in its own process group, killing the whole group on timeout.

    Args:
        argv: Worker command (after ``--``).
        workers: Number of workers (one server).
        extra_env: Variables on top of this environment (cluster variables removed).
        timeout: Seconds before everything is killed.
        launcher_args: More options of ``python -m bpstrain.launch``.

    Returns:
        ``(exit code, combined output, {check: {rank: {"ok", "error", ...}}})``.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                "BPSTRAIN_OP_TIMEOUT": "60", **extra_env})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "bpstrain.launch", "--workers", str(workers), "--servers", "1",
           *launcher_args, "--", *[str(a) for a in argv]]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[test] killed after {timeout} s"
    results = {}
    for line in out.splitlines():
        if "CHECK " in line:
            item = json.loads(line.split("CHECK ", 1)[1])
            results.setdefault(item["name"], {})[item["rank"]] = item
    return proc.returncode, out, results


def assert_check(job, name, workers):
    """Fails unless every rank reported check ``name`` as passed."""
    _, out, results = job
    got = results.get(name, {})
    assert len(got) == workers, f"check {name} reported by ranks {sorted(got)}:\n{out[-4000:]}"
    failed = {rank: r["error"] for rank, r in got.items() if not r["ok"]}
    assert not failed, f"{name}:\n" + "\n".join(f"[rank {k}] {v}" for k, v in failed.items())
