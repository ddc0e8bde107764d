"""The torch.distributed backend "bpstrain" (bpstrain/torch/process_group.py).

Multi-process checks run in launched jobs (torch_checks_c10d.py, through run_job of
test_torch_jobs.py); the one-process cases run here.
"""

import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import bpstrain.torch  # noqa: F401  (registers the backend)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_torch_jobs import _assert_check, run_job  # noqa: E402
from torch_check_worker import collect  # noqa: E402

C10D_GROUPS = ["torch_checks_c10d"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [name for name, _ in collect(C10D_GROUPS)])
def test_backend_checks_on_2_workers(name):
    _assert_check(run_job(2, 1, C10D_GROUPS), name, 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [name for name, _ in collect(C10D_GROUPS)])
def test_backend_checks_on_3_workers_2_servers_flat(name):
    job = run_job(3, 2, C10D_GROUPS, extra_env={"BPSTRAIN_HIERARCHICAL": "0"})
    _assert_check(job, name, 3)


@pytest.mark.timeout(60)
def test_backend_job_exits_cleanly():
    proc, _ = run_job(2, 1, C10D_GROUPS)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_one_process_group_without_a_job(monkeypatch):
    """Standalone (no DMLC_ROLE): rank 0 of 1, collectives return their input."""
    for name in ("DMLC_ROLE", "DMLC_PS_ROOT_PORT", "DMLC_WORKER_ID"):
        monkeypatch.delenv(name, raising=False)
    assert "bpstrain" in dist.Backend.backend_list
    dist.init_process_group("bpstrain", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    try:
        assert dist.get_backend() == "bpstrain" and dist.get_world_size() == 1
        t = torch.arange(4.0)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert torch.equal(t, torch.arange(4.0))
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
        model(torch.ones(2, 3)).sum().backward()
        assert model.module.weight.grad is not None
        with pytest.raises(NotImplementedError, match="new_group"):
            dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    finally:
        dist.destroy_process_group()


def test_torchrun_variables_stand_in_for_bytes_ones():
    from bpstrain.config.env import read_env
    from bpstrain.errors import ConfigError

    base = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_PORT": "9000"}
    torchrun = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "WORLD_SIZE": "6",
                "RANK": "3"}
    env = read_env({**base, **torchrun})
    assert (env.local_rank, env.local_size, env.worker_id, env.num_worker_hosts) == (1, 2, 1, 3)
    assert env.rank_hint == 3 and env.num_workers == 6 and env.local_size_given
    mine = {"BYTEPS_LOCAL_RANK": "0", "BYTEPS_LOCAL_SIZE": "1", "DMLC_WORKER_ID": "0",
            "DMLC_NUM_WORKER": "1"}
    env = read_env({**base, **torchrun, **mine})  # BytePS's variables win
    assert (env.local_rank, env.local_size, env.worker_id, env.num_worker_hosts) == (0, 1, 0, 1)
    env = read_env({"DMLC_ROLE": "server", "DMLC_PS_ROOT_PORT": "9000", **torchrun})
    assert (env.local_rank, env.local_size, env.worker_id) == (0, 1, None)  # workers only
    with pytest.raises(ConfigError, match="multiple of LOCAL_WORLD_SIZE"):
        read_env({**base, **torchrun, "WORLD_SIZE": "5"})


@pytest.mark.timeout(180)
def test_torchrun_workers_on_a_scheduler_and_server_started_by_hand(tmp_path):
    """BytePS's roles by hand for scheduler and server; torchrun starts the workers."""
    from torchrun_job import run_torchrun_job

    proc, results = run_torchrun_job(Path(__file__).parent / "c10d_torchrun_worker.py", tmp_path,
                                     op_timeout=20, timeout=150)
    assert proc.returncode == 0 and len(results) == 2, (proc.stdout + proc.stderr)[-3000:]
    for r in results:
        assert r["size"] == 2 and r["rank"] == r["env_rank"] == r["bps_rank"] and r["sum"] == 3.0, r
    assert results[0]["weights"] == results[1]["weights"]  # DDP kept the replicas equal


HOROVOD_GROUPS = ["torch_checks_horovod"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [name for name, _ in collect(HOROVOD_GROUPS)])
def test_horovod_calls_on_2_workers(name):
    _assert_check(run_job(2, 1, HOROVOD_GROUPS), name, 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [name for name, _ in collect(HOROVOD_GROUPS)])
def test_horovod_calls_on_3_workers_2_servers_flat(name):
    _assert_check(run_job(3, 2, HOROVOD_GROUPS, extra_env={"BPSTRAIN_HIERARCHICAL": "0"}), name, 3)


@pytest.mark.timeout(60)
def test_horovod_calls_alone(monkeypatch):
    """Rank 0 of 1: the same calls are identities (a script runs without a launcher)."""
    import bpstrain.torch as hvd

    for name in [n for n in __import__("os").environ if n.startswith("DMLC_")]:
        monkeypatch.delenv(name)
    hvd.shutdown()
    hvd.init()
    try:
        x = torch.arange(3.0)
        assert torch.equal(hvd.allreduce(x, op=hvd.Sum), x) and torch.equal(hvd.allgather(x), x)
        assert hvd.allreduce_(x, postscale_factor=2.0) is x and torch.equal(x, 2 * torch.arange(3.0))
        hvd.barrier()
        bn, ref = hvd.SyncBatchNorm(2), torch.nn.BatchNorm1d(2)
        inp = torch.randn(5, 2)
        assert torch.allclose(bn(inp), ref(inp)) and torch.allclose(bn.running_var, ref.running_var)
    finally:
        hvd.shutdown()
