"""launch --slurm without Slurm: node lists, counts, each task's part, and the errors."""

import sys

import pytest

from bpstrain.errors import ConfigError
from bpstrain.launch._cli import main
from bpstrain.launch.slurm import expand_counts, expand_nodelist, plan, port_for


def _addr(name: str) -> str:
    return f"10.0.0.{int(name[-1])}"


def _env(node: str, local_id: int, nodes="n[1-4]", tasks="2(x4)", **extra) -> dict:
    return {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_LOCALID": str(local_id),
            "SLURMD_NODENAME": node, "SLURM_STEP_NODELIST": nodes,
            "SLURM_STEP_TASKS_PER_NODE": tasks, **extra}


@pytest.mark.parametrize("text, names", [
    ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
    ("gpu07", ["gpu07"]),
    ("n[08-10],login", ["n08", "n09", "n10", "login"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a[1-2]-ib,b[3]", ["a1-ib", "a2-ib", "b3"]),
])
def test_node_lists_expand_as_scontrol_show_hostnames(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("text", ["node[1-3", "node[3-1]", "node[a]", "n]1["])
def test_malformed_node_list_is_an_error(text):
    with pytest.raises(ConfigError, match="malformed Slurm node list"):
        expand_nodelist(text)


def test_counts_expand_and_malformed_ones_name_the_variable():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE='2x3'"):
        expand_counts("2x3", "SLURM_TASKS_PER_NODE")


def test_port_depends_on_job_and_step_and_stays_below_the_ephemeral_range():
    ports = {port_for(job, step) for job in range(1000, 1100) for step in range(3)}
    assert len(ports) == 300 and all(20000 <= p < 32000 for p in ports)


def test_one_task_per_worker_follows_the_placement():
    first = plan(_env("n1", 0), resolve=_addr)
    assert (first.scheduler, first.server_id, first.worker_id, first.local_ranks) == \
        (True, 0, 0, (0,))
    other = plan(_env("n3", 1), resolve=_addr)
    assert (other.scheduler, other.server_id, other.worker_id, other.local_ranks) == \
        (False, None, 2, (1,))
    lead = plan(_env("n3", 0), resolve=_addr)
    assert lead.server_id == 2 and not lead.scheduler
    assert lead.env == {"DMLC_NUM_WORKER": "4", "BYTEPS_LOCAL_SIZE": "2",
                        "DMLC_NUM_SERVER": "4", "DMLC_PS_ROOT_URI": "10.0.0.1",
                        "DMLC_PS_ROOT_PORT": str(port_for(77, 0)), "BPSTRAIN_HOST_ID": "n3",
                        "DMLC_NODE_HOST": "10.0.0.3"}


def test_one_task_per_node_starts_local_size_workers_or_one_per_gpu():
    task = plan(_env("n2", 0, tasks="1(x4)"), local_size=3, resolve=_addr)
    assert task.local_ranks == (0, 1, 2) and task.env["BYTEPS_LOCAL_SIZE"] == "3"
    gpus = plan(_env("n2", 0, tasks="1(x4)", SLURM_GPUS_ON_NODE="4"), resolve=_addr)
    assert gpus.local_ranks == (0, 1, 2, 3)
    assert plan(_env("n2", 0, tasks="1(x4)"), resolve=_addr).local_ranks == (0,)


def test_heterogeneous_step_gives_later_components_the_servers():
    het = dict(nodes="n[1-4]", tasks="2(x2),1(x2)", SLURM_JOB_NODELIST_PACK_GROUP_0="n[1-2]",
               SLURM_JOB_NODELIST_PACK_GROUP_1="n[3-4]", SLURM_JOB_ID_PACK_GROUP_0="70")
    server = plan(_env("n4", 0, **het), resolve=_addr)
    assert (server.scheduler, server.server_id, server.worker_id) == (False, 1, None)
    assert server.env["DMLC_NUM_SERVER"] == "2" and server.env["DMLC_NUM_WORKER"] == "2"
    assert server.env["DMLC_PS_ROOT_PORT"] == str(port_for(70, 0))  # the leader's id
    lead = plan(_env("n1", 0, **het), resolve=_addr)
    assert (lead.scheduler, lead.server_id, lead.worker_id) == (True, None, 0)
    mixed = plan(_env("n1", 0, **het), mixed=True, resolve=_addr)
    assert mixed.server_id == 2 and mixed.env["DMLC_NUM_SERVER"] == "4"


@pytest.mark.parametrize("env, kwargs, message", [
    (_env("n1", 0, tasks="2,1,2,2"), {}, "SLURM_STEP_TASKS_PER_NODE='2,1,2,2'"),
    (_env("n1", 0), {"local_size": 2}, "run one task per node"),
    (_env("n1", 0, tasks="2(x3)"), {}, "one count per node"),
    (_env("n9", 0), {}, "SLURMD_NODENAME='n9' is not in the step's nodes"),
    (_env("n1", 0, SLURM_STEP_ID="batch"), {}, "batch script or an salloc shell itself. .*SLURM_STEP_ID='batch'"),
    (_env("n1", 0), {"mixed": False}, "--no-mixed leaves the job without a server"),
    ({"SLURM_JOB_ID": "5"}, {}, "not in the batch script or an salloc shell itself"),
    (_env("n1", 0, SLURM_JOB_NODELIST_HET_GROUP_0="n[1-3]",
          SLURM_JOB_NODELIST_HET_GROUP_1="n[3-4]"), {}, "node n3 belongs to several"),
])
def test_an_allocation_that_cannot_form_a_job_is_an_error_naming_it(env, kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        plan(env, resolve=_addr, **kwargs)


def test_unresolvable_node_name_is_an_error():
    def fail(name):
        raise OSError(f"no address for {name}")
    with pytest.raises(ConfigError, match="cannot resolve Slurm node name 'n1'"):
        plan(_env("n1", 0), resolve=fail)


def test_cli_exits_2_outside_slurm_and_with_local_only_flags(capsys):
    assert main(["--slurm", "--", sys.executable], environ={"PATH": ""}) == 2
    assert "SLURM_JOB_ID is not set" in capsys.readouterr().err
    assert main(["--slurm", "--workers", "2", "--", sys.executable], environ={}) == 2
    assert "--workers does not apply with --slurm" in capsys.readouterr().err


def test_trainer_takes_a_step_of_several_tasks_for_slurm_and_a_launched_worker_for_a_rank():
    from bpstrain.config import load_config
    from bpstrain.trainer import launch_mode

    auto, two = load_config({}), load_config({"cluster.workers": 2})
    step = _env("n1", 0, SLURM_STEP_NUM_TASKS="8")
    assert launch_mode(auto, step) == "slurm"
    assert launch_mode(two, {**step, "SLURM_STEP_NUM_TASKS": "1"}) == "local_cluster"
    assert launch_mode(two, {"SLURM_JOB_ID": "5"}) == "local_cluster"  # batch script, salloc
    assert launch_mode(auto, {**step, "DMLC_ROLE": "worker"}) == "rank"  # under --slurm
    assert launch_mode(load_config({"cluster.launcher": "slurm"}), {}) == "slurm"
    assert launch_mode(load_config({"cluster.launcher": "local"}), step) == "in_process"


@pytest.mark.timeout(90)
def test_the_launcher_passes_usr1_on_to_its_workers_and_its_roles_ignore_it(tmp_path):
    """One task of a fake one-node step starts scheduler, server and 2 workers; SIGUSR1 to
    the launcher alone (as a site whose process tracking signals only the task's own
    process group would deliver ``--signal=USR1@90``) reaches both workers, and no role
    dies of it."""
    import os
    import signal
    import subprocess
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "BPSTRAIN_RENDEZVOUS_TIMEOUT": "60",
           **_env("localhost", 0, nodes="localhost", tasks="1", SLURM_JOB_ID=str(
               1000 + os.getpid() % 5000))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bpstrain.launch", "--slurm", "--local-size", "2", "--",
         sys.executable, str(root / "tests" / "launch" / "usr1_worker.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    lines = []
    try:
        deadline = time.monotonic() + 60
        while sum("ready" in line for line in lines) < 2:
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        os.kill(proc.pid, signal.SIGUSR1)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines) + out
    assert proc.returncode == 0, text
    for rank in (0, 1):
        assert f"rank {rank} got USR1" in text and f"rank {rank} sum 2" in text, text
