"""bpstrain.torch in real multi-process jobs (launcher + scheduler + servers + workers).

Each job runs many checks in one launch (torch_check_worker.py) because every worker
process pays the torch import; the tests here report the checks one by one.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CPU_GROUPS = ["torch_checks_api", "torch_checks_optim_state", "torch_checks_training"]
sys.path.insert(0, str(HERE))
from torch_check_worker import collect  # noqa: E402

_jobs = {}


def run_job(workers, servers, groups, extra_env=None, timeout=240):
    """Runs one launched job (cached per arguments); returns {check: {rank: result}}."""
    key = (workers, servers, tuple(groups), tuple(sorted((extra_env or {}).items())))
    if key in _jobs:
        return _jobs[key]
    env = {**os.environ, "BPSTRAIN_OP_TIMEOUT": "20", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    for name in [n for n in env if n.startswith("DMLC_")]:
        del env[name]
    cmd = [sys.executable, "-m", "bpstrain.launch", "--workers", str(workers), "--servers",
           str(servers), "--", sys.executable, str(HERE / "torch_check_worker.py"), *groups]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    results = {}
    for line in proc.stdout.splitlines():
        if "CHECK " in line:
            item = json.loads(line.split("CHECK ", 1)[1])
            results.setdefault(item["name"], {})[item["rank"]] = item
    _jobs[key] = (proc, results)
    return _jobs[key]


def _assert_check(job, name, workers):
    proc, results = job
    got = results.get(name, {})
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert len(got) == workers, f"check {name} reported by ranks {sorted(got)}; output:\n{tail}"
    failed = {rank: r["error"] for rank, r in got.items() if not r["ok"]}
    assert not failed, f"check {name} failed:\n" + "\n".join(f"[rank {k}] {v}" for k, v in failed.items())


CPU_CHECKS = [name for name, _ in collect(CPU_GROUPS)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CPU_CHECKS)
def test_cpu_checks_on_2_workers(name):
    job = run_job(2, 1, CPU_GROUPS)
    _assert_check(job, name, 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CPU_CHECKS)
def test_cpu_checks_on_3_workers_2_servers(name):
    job = run_job(3, 2, CPU_GROUPS)
    _assert_check(job, name, 3)


DECLARE_GROUPS = ["torch_checks_declare"]
FLAT = {"BPSTRAIN_HIERARCHICAL": "0"}  # every worker talks to the servers itself


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [name for name, _ in collect(DECLARE_GROUPS)])
def test_declaration_checks_on_3_workers(name):
    job = run_job(3, 1, DECLARE_GROUPS, extra_env=FLAT)
    _assert_check(job, name, 3)


@pytest.mark.timeout(300)
def test_hierarchical_path_declares_a_name_again():
    job = run_job(2, 1, DECLARE_GROUPS)  # two workers on one host: hierarchical=auto
    _assert_check(job, "check_name_may_change_shape_when_every_rank_changes_it", 2)


@pytest.mark.timeout(300)
def test_k_of_n_aggregation_leaves_out_a_slow_rank_and_keeps_models_equal():
    # comm.aggregate=k:2 of 3 workers; auto turns the hierarchical path off for it.
    job = run_job(3, 2, ["torch_checks_aggregate"], extra_env={"BPSTRAIN_AGGREGATE": "k:2"})
    _assert_check(job, "check_a_slow_rank_does_not_count_yet_every_rank_keeps_the_same_model", 3)
    _assert_check(job, "check_catch_up_lets_a_slow_rank_skip_rounds_and_keep_the_same_model", 3)


def _value(job, name, workers):
    _assert_check(job, name, workers)
    return job[1][name][0]["value"]


DIGITS = "check_digits_200_steps_fingerprint"


@pytest.mark.timeout(300)
def test_ssp_0_with_the_optimizer_on_the_servers_equals_sync_bit_for_bit():
    sync = _value(run_job(2, 1, ["torch_checks_consistency"]), DIGITS, 2)
    ssp0 = _value(run_job(2, 1, ["torch_checks_consistency"], extra_env={"BPSTRAIN_CONSISTENCY": "ssp:0"}),
                  DIGITS, 2)
    assert ssp0["digest"] == sync["digest"], (sync, ssp0)
    assert sync["accuracy"] > 0.9 and ssp0["max_staleness"] == 0


@pytest.mark.timeout(300)
def test_async_with_lr_0_keeps_rank_0s_initial_weights():
    job = run_job(2, 1, ["torch_checks_consistency"], extra_env={"BPSTRAIN_CONSISTENCY": "async"})
    _assert_check(job, "check_async_lr_0_keeps_rank_0_initial_weights_exactly", 2)
    assert _value(job, DIGITS, 2)["accuracy"] > 0.85  # async trains digits too


@pytest.mark.timeout(300)
def test_ssp_with_a_scripted_slow_rank_equals_an_in_process_replay():
    job = run_job(2, 1, ["torch_checks_consistency"], extra_env={"BPSTRAIN_CONSISTENCY": "ssp:2"})
    _assert_check(job, "check_ssp_with_a_scripted_slow_rank_equals_the_simulation", 2)
    assert _value(job, DIGITS, 2)["max_staleness"] <= 2


@pytest.mark.timeout(300)
def test_a_table_ten_times_a_workers_memory_cap_trains_on_the_servers():
    job = run_job(2, 2, ["torch_checks_storage"])
    _assert_check(job, "check_a_table_ten_times_the_worker_memory_cap_trains", 2)


EMBEDDING_GROUPS = ["torch_checks_embedding"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers,servers", [(2, 1), (3, 2)])
@pytest.mark.parametrize("name", [name for name, _ in collect(EMBEDDING_GROUPS)])
def test_server_embedding_layers_train_like_one_process(name, workers, servers):
    job = run_job(workers, servers, EMBEDDING_GROUPS)
    _assert_check(job, name, workers)


@pytest.mark.timeout(30)
def test_jobs_exit_cleanly():
    for workers, servers in ((2, 1), (3, 2)):
        proc, _ = run_job(workers, servers, CPU_GROUPS)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def _cuda_available():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


CUDA_GROUPS = ["torch_checks_cuda"]


@pytest.mark.skipif(not _cuda_available(), reason="needs CUDA")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [name for name, _ in collect(CUDA_GROUPS)])
def test_cuda_checks_on_2_workers(name):
    job = run_job(2, 1, CUDA_GROUPS, extra_env={"BYTEPS_PARTITION_BYTES": str(1 << 20)})
    _assert_check(job, name, 2)


@pytest.mark.skipif(not _cuda_available(), reason="needs CUDA")
@pytest.mark.timeout(300)
def test_cuda_job_exits_cleanly():
    """Every process of the CUDA job (scheduler and server included) exits with 0."""
    proc, _ = run_job(2, 1, CUDA_GROUPS, extra_env={"BYTEPS_PARTITION_BYTES": str(1 << 20)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
