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
