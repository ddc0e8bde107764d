"""``python -m bpstrain.launch --slurm`` under a real Slurm: 4 nodes (slurmctld + 4 slurmd).

Both conventions on 4 nodes x 2 workers, a heterogeneous step whose second component runs
the servers, an allocation that cannot form a job, and a task killed outright.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.result_lines import read_results

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LAUNCH = [sys.executable, "-m", "bpstrain.launch", "--slurm"]
E2E = [sys.executable, str(REPO / "tests" / "launch" / "e2e_worker.py")]
HOLD = [sys.executable, str(HERE / "hold_worker.py")]
# A job that cannot form must fail in seconds, not after the default 600 s.
ENV = {"BPSTRAIN_RENDEZVOUS_TIMEOUT": "60", "PYTHONPATH": str(REPO)}


def _layout(output: str) -> dict:
    """node -> roles, from the launcher's one line per task."""
    found: dict = {}
    for node, roles in re.findall(r"\[launch\] Slurm step \S+, node (\S+): (.+?) \(", output):
        found.setdefault(node, []).append(roles)
    return {node: sorted(roles) for node, roles in found.items()}


def _sums(proc: subprocess.CompletedProcess, size: int) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = size * (size + 1) // 2
    for rank in range(size):
        line = f"[worker {rank}] rank {rank} of {size}: sum {expected} expected {expected}"
        assert line in proc.stdout.splitlines(), proc.stdout + proc.stderr


@pytest.mark.timeout(150)
def test_one_task_per_worker_on_4_nodes_of_2(slurm):
    start = time.monotonic()
    proc = slurm.srun("-N", "4", "--ntasks-per-node=2", *LAUNCH, "--", *E2E, **ENV)
    print(f"4 nodes x 2 tasks: srun took {time.monotonic() - start:.1f}s")
    _sums(proc, 8)
    # Ranks follow the placement; the first task of each node runs its server, the
    # first node's first task the scheduler.
    assert _layout(proc.stderr) == {
        "bpsnode1": ["scheduler + server 0 + worker 0", "worker 1"],
        "bpsnode2": ["server 1 + worker 2", "worker 3"],
        "bpsnode3": ["server 2 + worker 4", "worker 5"],
        "bpsnode4": ["server 3 + worker 6", "worker 7"]}, proc.stderr
    assert "scheduler at 127.0.2.1:" in proc.stderr


@pytest.mark.timeout(90)
def test_one_task_per_node_starts_the_local_workers(slurm):
    proc = slurm.srun("-N", "4", "--ntasks-per-node=1", *LAUNCH, "--local-size", "2",
                      "--", *E2E, **ENV)
    _sums(proc, 8)
    assert _layout(proc.stderr) == {
        "bpsnode1": ["scheduler + server 0 + workers 0, 1"],
        "bpsnode2": ["server 1 + workers 2, 3"],
        "bpsnode3": ["server 2 + workers 4, 5"],
        "bpsnode4": ["server 3 + workers 6, 7"]}, proc.stderr


@pytest.mark.timeout(90)
def test_heterogeneous_step_runs_the_servers_on_the_second_component(slurm):
    proc = slurm.srun("-N", "2", "--ntasks-per-node=2", *LAUNCH, "--", *E2E, ":",
                      "-N", "2", "--ntasks-per-node=1", *LAUNCH, "--", *E2E, **ENV)
    _sums(proc, 4)
    assert _layout(proc.stderr) == {
        "bpsnode1": ["scheduler + worker 0", "worker 1"],
        "bpsnode2": ["worker 2", "worker 3"],
        "bpsnode3": ["server 0"], "bpsnode4": ["server 1"]}, proc.stderr
    assert "2 worker node(s) x 2, 2 server(s)" in proc.stderr


@pytest.mark.timeout(60)
def test_uneven_tasks_per_node_is_an_error_naming_the_variable(slurm):
    proc = slurm.srun("-N", "2", "-n", "3", *LAUNCH, "--", *E2E, timeout=45, **ENV)
    assert proc.returncode != 0
    assert "every worker node must run the same number of tasks" in proc.stderr, proc.stderr
    assert "SLURM_STEP_TASKS_PER_NODE='2,1'" in proc.stderr, proc.stderr


def _killed_tasks(output: str) -> set:
    """The task ids srun reports as killed: "task 5: Killed" or "tasks 4-5: Killed"."""
    killed = set()
    for first, last in re.findall(r"tasks? (\d+)(?:-(\d+))?: Killed", output):
        killed.update(range(int(first), int(last or first) + 1))
    return killed


@pytest.mark.timeout(120)
def test_a_killed_task_ends_the_step_with_a_clear_error(slurm):
    srun = subprocess.Popen(["srun", "-N", "4", "--ntasks-per-node=2", *LAUNCH, "--", *HOLD],
                            env={**slurm.env, **ENV}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(iter(srun.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        held = {}
        deadline = time.monotonic() + 60
        while len(held) < 8 and time.monotonic() < deadline and srun.poll() is None:
            for line in list(lines):
                match = re.search(r"rank (\d+) launcher (\d+) pid (\d+)", line)
                if match:
                    held[int(match[1])] = (int(match[2]), int(match[3]))
            time.sleep(0.1)
        assert len(held) == 8, "".join(lines)
        os.kill(held[5][0], signal.SIGKILL)  # a task with only a worker: the hardest case
        killed_at = time.monotonic()
        code = srun.wait(60)
        took = time.monotonic() - killed_at
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.wait()
    reader.join(10)
    output = "".join(lines)
    assert code != 0, output
    assert took < 45, f"the step took {took:.0f}s to end after the kill:\n{output}"
    # srun folds tasks of one node killed together into a range ("tasks 4-5: Killed") when
    # the step's cancellation reaches task 4 before srun reports task 5.
    assert 5 in _killed_tasks(output), output
    assert re.search(r"\[launch\] a process on node bpsnode\d failed \(exit code \d+\); "
                     r"cancelling Slurm step \d+\.0", output), output
    time.sleep(1)
    left = [pid for _, pid in held.values() if os.path.exists(f"/proc/{pid}")
            and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not left, f"workers still running: {left}\n{output}"


@pytest.mark.timeout(120)
def test_trainer_under_a_bare_srun_finds_the_step_itself(slurm, tmp_path):
    """`srun python train.py`, no launcher: each task is one rank (cluster.launcher auto)."""
    proc = slurm.srun("-N", "2", "--ntasks-per-node=1", sys.executable,
                      str(HERE / "trainer_fit.py"), str(tmp_path), timeout=100, **ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = read_results(proc.stdout)
    assert sorted((r["rank"], r["size"]) for r in results) == [(0, 2), (1, 2)], proc.stdout
    # 256 samples / 2 ranks / 32 per batch = 4 steps an epoch; one run folder, named once.
    assert {r["steps"] for r in results} == {8} and len({r["run"] for r in results}) == 1
    assert results[0]["val_accuracy"] > 0.5
    assert (tmp_path / results[0]["run"] / "checkpoints" / "last.ckpt").is_file()
