"""A worker of the fault-tolerance jobs (test_fault_tolerance_jobs.py): a linear model
trained with DistributedOptimizer for STEPS steps; with ``--fault kill|stop`` the worker of
rank ``--victim`` kills (SIGKILL) or stops (SIGSTOP, resumed a few seconds later) itself
just before step ``--at`` computes its gradient; with ``--fault scheduler`` it kills the
job's scheduler (its launcher's child) instead and every worker finishes; with
``--fault server-kill|server-stop`` it kills or stops one of the job's servers. With
``--join-at J`` the training state is a ``bpstrain.torch.elastic.TorchState`` committed
after every step, the launcher restarts the killed worker (``--max-restarts``), which
joins at a commit (the others wait at step J's until it has) and goes on from their state.
With ``--scale-up-at S`` as well, rank 0 starts one more worker by hand at step S (a
``DMLC_ROLE=worker`` process with no ``DMLC_WORKER_ID``: a new rank, under
``BPSTRAIN_MAX_WORKERS``), or with ``--scale-up-with launcher`` through ``python -m
bpstrain.launch --join $BPSTRAIN_JOIN_FILE``, which joins the same way. Each worker
that finishes prints one ``FT_RESULT`` line: its final parameters, rank()/size() before
and after, the membership events its callback saw and each step's seconds (the step of
the fault holds the detection)."""

import argparse
import os
import signal
import subprocess
import sys
import time

import torch

import bpstrain.torch as bps
from bpstrain import engine
from bpstrain.launch._procs import child_pids
from tests.result_lines import write_result

STEPS = 12
SAMPLES, BATCH = 56, 2  # the ElasticSampler's epoch: 3 workers x 5 steps, then 2 workers cover the rest


def rank_data(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 4, generator=g)
    return x, x.sum(1, keepdim=True) * 0.5


def signal_a_service(role, sig=signal.SIGKILL):
    """Sends ``sig`` to a process the launcher started beside this worker with DMLC_ROLE
    ``role`` (the scheduler, or the first server found); returns its pid."""
    for pid in child_pids(os.getppid()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"DMLC_ROLE={role}".encode() in env:
            os.kill(pid, sig)
            return pid
    raise RuntimeError(f"no {role} process found beside this worker")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--fault", choices=("none", "kill", "stop", "scheduler", "server-kill", "server-stop"),
                   default="none")
    p.add_argument("--victim", type=int, default=2)
    p.add_argument("--at", type=int, default=5)
    p.add_argument("--join-at", type=int, default=0)
    p.add_argument("--scale-up-at", type=int, default=0)
    p.add_argument("--scale-up-with", choices=("env", "launcher"), default="env")
    args = p.parse_args(argv)
    if args.join_at:
        return elastic(args)
    bps.init()
    start = (bps.rank(), bps.size())
    events = []
    engine.on_membership_change(lambda m: events.append(m))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    me = start[0]  # the rendezvous rank: what the data and the fault schedule follow
    # Besides the model's fixed data, an ElasticSampler's indices (dealt again when a
    # worker leaves): which samples each survivor would have trained on.
    sampler = bps.ElasticSampler(range(SAMPLES), shuffle=True, seed=5)
    sampler.set_epoch(0)
    indices, it = [], iter(sampler)
    times = []
    for step in range(STEPS):
        t0 = time.perf_counter()
        batch = [i for _, i in zip(range(BATCH), it)]
        if me == args.victim and step == args.at:
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fault == "stop":
                subprocess.Popen(["sh", "-c", f"sleep 6; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGSTOP)  # resumed: the job went on without it
            if args.fault == "scheduler":
                signal_a_service("scheduler")
            if args.fault == "server-kill":
                signal_a_service("server")
            if args.fault == "server-stop":  # hangs; resumed later, it learns it was replaced and exits
                pid = signal_a_service("server", signal.SIGSTOP)
                subprocess.Popen(["sh", "-c", f"sleep 8; kill -CONT {pid}"])
        if args.fault == "scheduler" and step == args.at:
            # Every worker waits here until it noticed (its control link closing): the
            # remaining steps take milliseconds, and the test checks that all saw it go.
            deadline = time.monotonic() + 10
            while engine.membership()["scheduler_alive"] and time.monotonic() < deadline:
                time.sleep(0.01)
        x, y = rank_data(me, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sampler.record_batch(len(batch))
        indices.append(batch)
        times.append(time.perf_counter() - t0)
    # rank()/size() change when this worker hears from the scheduler, which may come after
    # the servers' answers computed without the departed (membership()'s epoch against
    # answered_epoch): the last steps take milliseconds, so wait for the word, bounded.
    deadline = time.monotonic() + 10
    while (engine.membership()["epoch"] < engine.membership()["answered_epoch"]
           and time.monotonic() < deadline):
        time.sleep(0.01)
    params = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    write_result({"rank": me, "start": start, "end": [bps.rank(), bps.size()], "params": params, "events": events,
                  "times": times, "indices": indices, "scheduler_alive": engine.membership()["scheduler_alive"]}, "FT_RESULT")
    bps.shutdown()
    return 0


def elastic(args):
    """The loop of a Horovod-elastic script: the state is synced at the start (a restarted
    process gets the others' state there) and committed after every step."""
    bps.init()
    start = (bps.rank(), bps.size())
    me = engine.membership()["rendezvous_rank"]
    events = []
    engine.on_membership_change(lambda m: events.append({k: m[k] for k in ("epoch", "departed", "size",
                                                                             "joined")}))
    torch.manual_seed(0 if me != args.victim else 99)  # a joiner's own start is overwritten
    model = torch.nn.Linear(4, 1)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    sampler = bps.ElasticSampler(range(SAMPLES), shuffle=True, seed=5)
    state = bps.elastic.TorchState(model, opt, sampler=sampler, step=0)
    sync_pulled = []  # bytes this worker downloaded while the state was sent at the join

    def pulled_in(call):
        before = engine.stats()["bytes_pulled"]
        joined = call()
        if joined or engine.membership()["admitted_late"] and not sync_pulled:
            sync_pulled.append(engine.stats()["bytes_pulled"] - before)

    pulled_in(state.sync)
    first, restarted = state.step, os.environ.get("BPSTRAIN_RESTART")
    indices, it, times, started = [], iter(sampler), [], None
    while state.step < STEPS:
        t0 = time.perf_counter()
        batch = [i for _, i in zip(range(BATCH), it)]
        if me == args.victim and state.step == args.at and not restarted:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.scale_up_at and me == 0 and state.step == args.scale_up_at:
            if args.scale_up_with == "launcher":  # the job's command, as its launcher says
                started = subprocess.Popen([sys.executable, "-m", "bpstrain.launch", "--join",
                                            os.environ["BPSTRAIN_JOIN_FILE"]])
            else:
                env = {k: v for k, v in os.environ.items() if k not in ("DMLC_WORKER_ID", "BPSTRAIN_HOST_ID")}
                started = subprocess.Popen([sys.executable, *sys.argv], env=env)
        x, y = rank_data(me, state.step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sampler.record_batch(len(batch))
        indices.append(batch)
        state.step += 1
        pulled_in(state.commit)
        deadline = time.monotonic() + 90
        while state.step == args.join_at and bps.size() < 3:  # it may have joined earlier
            assert time.monotonic() < deadline, "the restarted worker never joined"
            time.sleep(0.05)
            pulled_in(state.commit)
        times.append(time.perf_counter() - t0)
    params = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    write_result({"rank": me, "start": start, "end": [bps.rank(), bps.size()], "params": params, "events": events,
                  "first_step": first, "restarted": restarted, "indices": indices, "times": times,
                  "syncs": state.syncs, "sync_pulled": sync_pulled}, "FT_RESULT")
    bps.shutdown()
    if started is not None:
        started.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
