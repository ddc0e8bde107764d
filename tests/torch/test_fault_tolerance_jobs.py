"""comm.fault_tolerance with real processes: a launched 3-worker torch job in which one
worker is killed (SIGKILL) or stopped (SIGSTOP) mid-training; the other two finish every
step, end with equal parameters, equal to a replay that averages over the workers in the
job at each step (3 before the fault, 2 after: nothing committed is lost), and see the
new membership through rank()/size() and the callback. The same kill in a job whose roles
were each started by hand with BytePS's variables, no launcher owning it, is survived
alike. Without fault tolerance the same kill fails the job (the launcher's exit code)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bpstrain.launch import free_port
from tests.launch.launch_helpers import run_hand_started_job
from tests.result_lines import read_results

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from ft_train_worker import BATCH, SAMPLES, STEPS, rank_data  # noqa: E402

AT = 5


def job_env(fault_tolerance=True, **extra):
    """The environment of every process of these jobs: the repo importable, no DMLC_*
    variables of the caller's, a 3 s heartbeat timeout, and the switch."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "BPSTRAIN_OP_TIMEOUT": "30",
           "BPSTRAIN_TIMEOUT": "3", "BPSTRAIN_FAULT_TOLERANCE": "1" if fault_tolerance else "0"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    for name in [n for n in env if n.startswith("DMLC_")]:
        del env[name]
    return {**env, **extra}


def ft_results(stdout):
    """The FT_RESULT lines of the workers that finished, by rank."""
    results = read_results(stdout, "FT_RESULT")
    return sorted(results, key=lambda r: r["rank"])


def launch(fault, fault_tolerance=True, timeout=120, worker_args=(), launcher_args=(), servers=1, workers=3,
           env_extra=None):
    env = job_env(fault_tolerance, **(env_extra or {}))
    cmd = [sys.executable, "-m", "bpstrain.launch", "--workers", str(workers), "--servers", str(servers), *launcher_args, "--",
           sys.executable, str(HERE / "ft_train_worker.py"), "--fault", fault, "--at", str(AT), *worker_args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, ft_results(proc.stdout), time.monotonic() - t0


def replay(survivors_from=AT, rejoined_from=STEPS, momentum=0.0):
    """One process: SGD on the average of the gradients of the workers in the job (all
    three, but rank 2 not from step ``survivors_from`` until ``rejoined_from``)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for step in range(STEPS):
        ranks = range(3) if step < survivors_from or step >= rejoined_from else range(2)
        grads = []
        for r in ranks:
            model.zero_grad()
            x, y = rank_data(r, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = sum(gs) / len(gs)
        opt.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_survivors_finish_every_step_with_the_expected_parameters(fault):
    proc, results, _ = launch(fault)
    out = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, out
    assert [r["rank"] for r in results] == [0, 1], out  # the victim (rank 2) printed nothing
    a, b = results
    assert a["params"] == b["params"], out  # the survivors hold the same model, bit for bit
    want = replay()
    for got, ref in zip(a["params"], want):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    for r in results:
        assert r["start"] == [r["rank"], 3] and r["end"] == [r["rank"], 2], r
        assert [(e["epoch"], e["departed"], e["size"]) for e in r["events"]] == [(1, [2], 2)], r
    stall = max(max(r["times"][AT:AT + 1]) for r in results)  # the step that waited for the fault
    print(f"{fault}: the survivors' step {AT} took {stall:.2f} s (other steps: "
          f"{max(max(r['times'][AT + 1:]) for r in results) * 1e3:.0f} ms at most)")
    # The ElasticSampler dealt the samples nobody had consumed over the two survivors, both
    # after step AT (the first whose answers came without the victim): with what the victim
    # consumed before the fault (its share of a 3-way deal) every sample of the epoch is
    # covered, and the survivors' shares after the deal do not overlap.
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(5)).tolist()
    victim = order[2::3][:AT * BATCH]
    seen = [i for r in results for batch in r["indices"] for i in batch]
    assert set(seen) | set(victim) == set(range(SAMPLES)), (sorted(set(range(SAMPLES)) - set(seen) - set(victim)))
    after = [set(i for batch in r["indices"][AT + 1:] for i in batch) for r in results]
    assert not after[0] & after[1], after
    if fault == "kill":  # its connections drop at once
        assert stall < 2.0, stall
    if fault == "stop":  # no heartbeat for comm.timeout (3 s here); then it woke up, read the
        # notice that it left, and exited with the reason
        assert 2.5 < stall < 6.0, stall
        assert "declared gone" in proc.stderr, out


@pytest.mark.timeout(120)
def test_without_fault_tolerance_a_killed_worker_fails_the_job():
    proc, results, _ = launch("kill", fault_tolerance=False)
    assert proc.returncode != 0 and results == [], (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.timeout(180)
def test_a_hand_started_job_with_the_variable_set_survives_a_killed_worker_too():
    """Scheduler, server and three workers each started by hand with BytePS's DMLC_*
    variables and BPSTRAIN_FAULT_TOLERANCE=1, no launcher owning the job: rank 2 SIGKILLs
    itself before step AT, the two others finish every step with the replay's parameters,
    and the scheduler and the server end cleanly when they are done."""
    common = job_env(DMLC_NUM_WORKER="3", DMLC_NUM_SERVER="1", DMLC_PS_ROOT_URI="127.0.0.1",
                     DMLC_PS_ROOT_PORT=str(free_port()), BYTEPS_LOCAL_SIZE="1")
    codes, outputs = run_hand_started_job(common, [sys.executable, str(HERE / "ft_train_worker.py"), "--fault", "kill",
                                                   "--at", str(AT)], range(3), timeout=120)
    out = "\n".join(o[-1500:] for o in outputs)
    assert codes[:4] == [0, 0, 0, 0] and codes[4] != 0, out  # scheduler, server, ranks 0 and 1; the victim
    results = ft_results(outputs[2] + outputs[3])
    assert [r["rank"] for r in results] == [0, 1], out
    assert results[0]["params"] == results[1]["params"], out
    for got, ref in zip(results[0]["params"], replay()):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    for r in results:
        assert r["start"] == [r["rank"], 3] and r["end"] == [r["rank"], 2], r
        assert [(e["departed"], e["size"]) for e in r["events"]] == [([2], 2)], r


@pytest.mark.timeout(180)
def test_when_the_scheduler_is_killed_every_worker_finishes_without_it():
    """Rank 2 SIGKILLs the scheduler before step AT: the data path needs no scheduler, so
    all three workers finish every step with the parameters of a fault-free run, see
    that it is gone, and the job (launcher, servers) ends cleanly."""
    proc, results, _ = launch("scheduler")
    out = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, out
    assert [r["rank"] for r in results] == [0, 1, 2], out
    want = replay(survivors_from=STEPS)  # nobody left
    for r in results:
        assert r["params"] == results[0]["params"], out
        assert r["end"] == [r["rank"], 3] and r["events"] == [] and r["scheduler_alive"] is False, r
    for got, ref in zip(results[0]["params"], want):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert "scheduler exited with code" in proc.stderr and "go on without it" in proc.stderr, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["server-kill", "server-stop"])
def test_when_a_server_dies_or_hangs_its_partitions_move_and_no_step_is_lost(fault):
    """Rank 2 SIGKILLs (or SIGSTOPs) one of the two servers before step AT, while the
    others push that step: its partitions move to the other server, the rounds it had
    not answered are pushed again, and all three workers finish every step with the
    parameters of a fault-free run (nobody left). A hung server is lost after the 3 s
    heartbeat timeout; resumed, it learns it was replaced and exits."""
    proc, results, _ = launch(fault, servers=2, worker_args=["--victim", "2"])
    out = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, out
    assert [r["rank"] for r in results] == [0, 1, 2], out
    want = replay(survivors_from=STEPS)
    for r in results:
        assert r["params"] == results[0]["params"], out
        assert r["end"] == [r["rank"], 3] and r["events"] == [], r
    for got, ref in zip(results[0]["params"], want):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert "partitions move to the 1 other servers" in proc.stderr, out
    stall = max(max(r["times"][AT:AT + 1]) for r in results)
    print(f"{fault}: step {AT} took {stall:.2f} s at most")
    assert stall < (6 if fault == "server-stop" else 3), stall


@pytest.mark.timeout(180)
@pytest.mark.parametrize("local_size", [1, 3])
def test_a_killed_worker_is_restarted_and_rejoins_with_the_others_state(local_size):
    """Rank 2 SIGKILLs itself before step AT; the launcher (--max-restarts 1) starts it
    again; the new process waits in init() until the others' next state.commit(), gets
    their parameters, momentum buffers, sampler position and step there, and trains
    with them to the end. Everyone ends with the parameters of a replay that averages
    over 3 workers, then 2 from step AT, then 3 again from the step it joined at."""
    join_at = AT + 3
    proc, results, _ = launch("kill", worker_args=["--join-at", str(join_at)],
                              launcher_args=["--max-restarts", "1", "--local-size", str(local_size)])
    out = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, out
    assert [r["rank"] for r in results] == [0, 1, 2], out
    joiner = results[2]
    assert joiner["restarted"] == "1" and joiner["start"] == [2, 3] and joiner["end"] == [2, 3], joiner
    assert AT < joiner["first_step"] <= join_at, joiner
    for r in results:
        assert r["params"] == results[0]["params"], out  # the joiner too, bit for bit
    want = replay(rejoined_from=joiner["first_step"], momentum=0.9)
    for got, ref in zip(results[0]["params"], want):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    for r in results[:2]:
        assert r["end"] == [r["rank"], 3] and r["syncs"] == 2, r  # at the start, at the join
        assert [(e["departed"], e["size"], e["joined"]) for e in r["events"]] == [([2], 2, []), ([], 3, [2])], r
    # Only the joiner downloads the parameters and momentum buffers (engine.to_joiners):
    # 5 + 5 float32 more than the others, who get only what every rank needs (pickles).
    assert [len(r["sync_pulled"]) for r in results] == [1, 1, 1], results
    assert results[0]["sync_pulled"] == results[1]["sync_pulled"] == [joiner["sync_pulled"][0] - 40], results
    # From the join on the three deal the samples nobody consumed yet (the last share
    # padded by wrapping around, as DistributedSampler): every sample of the epoch is
    # trained, with what the victim consumed before it was killed.
    after = [i for r in results for batch in r["indices"][-(STEPS - joiner["first_step"]):] for i in batch]
    assert len(after) - len(set(after)) < 3, after
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(5)).tolist()
    seen = {i for r in results for batch in r["indices"] for i in batch} | set(order[2::3][:AT * BATCH])
    assert seen == set(range(SAMPLES)), sorted(set(range(SAMPLES)) - seen)
    assert "restarted it" in proc.stderr, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("started_with", ["env", "launcher"])
def test_a_worker_started_later_scales_the_job_up_and_gets_the_others_state(started_with):
    """A job launched with 2 workers and BPSTRAIN_MAX_WORKERS=3: rank 0 starts a third
    worker at step AT, by hand (DMLC_ROLE=worker, no DMLC_WORKER_ID) or with ``python -m
    bpstrain.launch --join $BPSTRAIN_JOIN_FILE`` (the job's command); it gets rank 2, waits
    in init() until a commit admits it, receives the parameters, momentum buffers, sampler
    position and step, and trains to the end. All three end with the parameters of a
    replay that averages 2 workers' gradients, then 3 from the step it joined at."""
    join_at = AT + 3
    proc, results, _ = launch("none", workers=2, env_extra={"BPSTRAIN_MAX_WORKERS": "3"},
                              worker_args=["--join-at", str(join_at), "--scale-up-at", str(AT), "--victim", "-1",
                                           "--scale-up-with", started_with])
    out = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, out
    assert [r["rank"] for r in results] == [0, 1, 2], out
    joiner = results[2]
    assert joiner["start"] == [2, 3] and joiner["end"] == [2, 3] and joiner["restarted"] is None, joiner
    assert AT < joiner["first_step"] <= join_at, joiner
    for r in results:
        assert r["params"] == results[0]["params"], out  # the joiner too, bit for bit
    want = replay(survivors_from=0, rejoined_from=joiner["first_step"], momentum=0.9)
    for got, ref in zip(results[0]["params"], want):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    for r in results[:2]:
        assert r["start"] == [r["rank"], 2] and r["end"] == [r["rank"], 3] and r["syncs"] == 2, r
        assert [(e["departed"], e["size"], e["joined"]) for e in r["events"]] == [([], 3, [2])], r
    # From the join on the three deal the samples nobody consumed yet: no sample twice
    # (but the padding of the last share), every sample of the epoch trained.
    after = [i for r in results for batch in r["indices"][-(STEPS - joiner["first_step"]):] for i in batch]
    assert len(after) - len(set(after)) < 3, after
    seen = {i for r in results for batch in r["indices"] for i in batch}
    assert seen == set(range(SAMPLES)), sorted(set(range(SAMPLES)) - seen)
    join_files = re.findall(r"add a worker with `python -m bpstrain.launch --join (\S+)`", proc.stderr)
    assert len(join_files) == 1 and not os.path.exists(join_files[0]), out  # said once, gone with the job
