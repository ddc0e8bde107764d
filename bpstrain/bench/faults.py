"""Training through faults on emulated hosts: bpstrain's fault tolerance vs torchrun's restarts.

    python -m bpstrain.bench.faults                          # 4 worker hosts, 2 server hosts, 800 Mbit/s
    python -m bpstrain.bench.faults --events kill stop cut --every 30 --steps 20000
    python -m bpstrain.bench.faults --systems bpstrain --json faults.json
    python -m bpstrain.bench.faults --every 60 --duration 600 --steps 1000000   # ten minutes per run

Every system trains the digits CNN (or ``--model vgg16``: VGG-16, 134 M parameters, on
the digits upscaled, 4 samples per worker and step) (:mod:`bpstrain.bench._faults_worker`) for the same
number of synchronous steps (or, with ``--duration``, for the same time, after which a run
is stopped and counted up to it), once without faults and once under a scripted schedule
that injects one event ``--every`` seconds after the first step, and each next one
``--every`` seconds after training resumed from the last, into worker host 1, 2, 3, 1, ...:

- ``kill``: the worker process is SIGKILLed;
- ``stop``: it is SIGSTOPped for ``--stop-s`` seconds (hung), then continued;
- ``cut``: its host's link goes down for ``--cut-s`` seconds (``ip link set eth0 down``
  in its namespace), then up again;
- ``server``: a server process is SIGKILLed (bpstrain only: its partitions move to the
  other servers; the last server first, one must stay).

bpstrain runs with ``comm.fault_tolerance`` and ``comm.timeout`` = ``--timeout``; the
workers commit a ``TorchState`` after every step; a worker process that exits non-zero
is started again (what ``python -m bpstrain.launch --max-restarts`` does on one host)
and rejoins at the next step. torchrun runs one agent per worker host (c10d rendezvous,
``--max-restarts``), DDP over gloo with its timeout = ``--timeout`` (``--collective-timeout``
where a step's allreduce takes longer), and a checkpoint by
rank 0 every ``--checkpoint-every`` steps: a failure restarts every worker from it.
torchft (``pip install torchft==0.2.0``) runs one replica group per worker host and its
lighthouse on the scheduler's host (heartbeat timeout ``--timeout``), with
the manager's allreduce over ``ProcessGroupGloo`` (timeout ``--timeout``): a
group that fails is left out of the next quorum, the others go on, and a failed worker
process is started again and recovers the state from a live group.

Per event the table gives: when the others noticed (bpstrain: the membership changed,
or for a server a worker finished a step over the moved partitions;
torchrun: the first worker process of the restart was launched), the stall (the longest
pause between two completed steps, from the event to the next event), the steps lost (completed before the event and
computed again after it), when the victim's replacement trained again; per run the
samples per second that count (bpstrain: the workers in each step; torchrun: every
step once) and their ratio to the same system's run without faults (the goodput), and
the final test accuracy. Root is needed (namespaces, tc); progress goes to stderr, the
tables to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from bpstrain.bench import _jobs, emulated
from bpstrain.bench._hosts import EmulatedHosts
from bpstrain.launch._procs import child_pids

_WORKER = "bpstrain.bench._faults_worker"
EVENTS = ("kill", "stop", "cut", "server")
# The models the workers train, and each one's per-rank batch: the digits CNN, and the
# VGG-16 of the training benchmark (its 134 M parameters on the same digits, upscaled).
MODELS = {"digits_cnn": 32, "vgg16": 4}


@dataclasses.dataclass
class Plan:
    """One benchmark: the hosts, the training and the fault schedule."""

    workers: int = 4
    servers: int = 2
    rate_mbit: float = 800.0
    steps: int = 10000
    events: Sequence[str] = ("kill", "stop", "cut", "kill")
    every: float = 20.0
    stop_s: float = 8.0
    cut_s: float = 8.0
    timeout: float = 5.0
    # torchrun's and torchft's gloo timeout: how long one collective may take (0 = timeout).
    # A step's allreduce must fit in it: VGG-16's 537 MB take longer than 5 s here.
    collective_timeout: float = 0.0
    model: str = "digits_cnn"
    checkpoint_every: int = 100
    systems: Sequence[str] = ("bpstrain", "torchrun", "torchft")
    run_timeout: float = 900.0
    keep: str = ""
    # Seconds of training per run, from its first step (0: until --steps): a goodput over
    # a fixed time, as "one failure a minute for ten minutes"; --steps is then a ceiling.
    duration: float = 0.0


@dataclasses.dataclass
class Injected:
    kind: str
    host: int
    at: float  # wall time


class _Run:
    """The processes of one run on the emulated hosts, started and restarted by name."""

    def __init__(self, hosts: EmulatedHosts, workdir: str):
        self.hosts, self.workdir = hosts, workdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, tuple] = {}
        self.lives: dict[str, int] = {}

    def start(self, name: str, host: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        life = self.lives.get(name, -1) + 1
        self.lives[name] = life
        out = open(os.path.join(self.workdir, f"{name}.{life}.log"), "w")
        proc = self.hosts.popen(host, argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        out.close()
        self.procs[name], self.argv[name] = proc, (host, argv, env)
        return proc

    def restart(self, name: str, **env) -> subprocess.Popen:
        host, argv, base = self.argv[name]
        return self.start(name, host, argv, {**base, **env})

    def logs(self, name: str) -> str:
        return "".join(open(p).read() for p in sorted(glob.glob(os.path.join(self.workdir, f"{name}.*.log"))))

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


def _log(message: str) -> None:
    print(f"[faults] {message}", file=sys.stderr, flush=True)


def _last_step_at(directory: str) -> float:
    """When a step was last completed (the newest write to a step file), 0 before any."""
    times = [os.path.getmtime(p) for p in glob.glob(os.path.join(directory, "*"))
             if "-launch-" not in p and os.path.getsize(p) > 200]  # past the start note
    return max(times, default=0.0)


def _first_step_at(directory: str) -> float:
    """When the first step was completed (wall time), 0 before any."""
    firsts = []
    for path in glob.glob(os.path.join(directory, "*")):
        with open(path) as f:
            line = next((line for line in f if line.strip() and not line.startswith("# ")), None)
        if line is not None:
            firsts.append(float(line.split()[1]))
    return min(firsts, default=0.0)


def _training(directory: str, since: float) -> bool:
    """Whether steps complete now, after the time ``since`` (an outage is over)."""
    last = _last_step_at(directory)
    return last > since and time.time() - last < 1.0


def _worker_pid(run: _Run, system: str, host_index: int) -> int | None:
    """The training process on worker host ``host_index``: ours, or torchrun's child."""
    proc = run.procs.get(f"worker{host_index}")
    if proc is None or proc.poll() is not None:
        return None
    if system != "torchrun":
        return proc.pid
    for pid in child_pids(proc.pid):  # the agent's child that runs the worker module
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if _WORKER.encode() in f.read():
                    return pid
        except OSError:
            continue
    return None


def _inject(plan: Plan, run: _Run, cluster: emulated.EmulatedCluster, system: str, progress: str,
            done: threading.Event, injected: list) -> None:
    """The fault schedule, in its own thread: one event each ``every`` seconds."""
    last = 0.0
    for i, kind in enumerate(plan.events):
        # The next event comes `every` seconds after training resumed from the last one:
        # each hits a running job (not a restart still in progress).
        while not _training(progress, last):
            if done.wait(0.2):
                return
        if done.wait(plan.every):
            return
        if kind == "server":  # SIGKILL a server: the last one first, never server 0
            if system != "bpstrain":
                _log(f"{system}: no servers to kill; skipped")
                continue
            j = plan.servers - 1 - sum(e.kind == "server" for e in injected)
            at = time.time()
            os.kill(run.procs[f"server{j}"].pid, signal.SIGKILL)
            injected.append(Injected(kind, plan.workers + j, at))
            last = at + 0.5
            _log(f"{system}: killed server {j}")
            continue
        host = 1 + i % (plan.workers - 1)  # never host 0: torchrun's rendezvous lives there
        pid, wait_until = _worker_pid(run, system, host), time.monotonic() + plan.every
        while kind in ("kill", "stop") and pid is None and time.monotonic() < wait_until:
            if done.wait(0.1):  # being restarted: the event waits for its victim
                return
            pid = _worker_pid(run, system, host)
        if kind in ("kill", "stop") and pid is None:
            _log(f"{kind}: no worker process on host {host} for {plan.every:g} s; skipped")
            continue
        at = time.time()
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
        elif kind == "stop":
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(plan.stop_s, lambda p=pid: _continue(p)).start()
        else:
            ns = cluster.netns(host)
            subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", cluster.ifname, "down"], check=True)
            threading.Timer(plan.cut_s, lambda n=ns: subprocess.run(
                ["ip", "netns", "exec", n, "ip", "link", "set", cluster.ifname, "up"], check=False)).start()
        injected.append(Injected(kind, host, at))
        last = at + 0.5
        _log(f"{system}: {kind} worker host {host}")


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _collective_timeout(plan: Plan) -> float:
    return plan.collective_timeout or plan.timeout


def _model_args(plan: Plan) -> list[str]:
    return ["--model", plan.model, "--batch", str(MODELS[plan.model])]


def _run_bpstrain(plan: Plan, hosts: EmulatedHosts, run: _Run, progress: str, faults: bool) -> None:
    sched_host = plan.workers + plan.servers
    common = {
        "DMLC_NUM_WORKER": str(plan.workers), "DMLC_NUM_SERVER": str(plan.servers),
        "DMLC_PS_ROOT_URI": hosts.addr(sched_host), "DMLC_PS_ROOT_PORT": str(hosts.next_port()),
        "DMLC_INTERFACE": hosts.ifname, "BPSTRAIN_FAULT_TOLERANCE": "1",
        "BPSTRAIN_TIMEOUT": str(plan.timeout), "BPSTRAIN_LAUNCH_PARENT": str(os.getpid()),
    }
    role = [sys.executable, "-m", "bpstrain.launch"]
    run.start("scheduler", sched_host, role, _jobs.child_env({**common, "DMLC_ROLE": "scheduler",
                                                              "DMLC_NODE_HOST": hosts.addr(sched_host)}))
    for j in range(plan.servers):
        host = plan.workers + j
        run.start(f"server{j}", host, role, _jobs.child_env({**common, "DMLC_ROLE": "server",
                                                             "DMLC_NODE_HOST": hosts.addr(host)}))
    argv = [sys.executable, "-m", _WORKER, "--system", "bpstrain", "--steps", str(plan.steps),
            "--progress", progress, *_model_args(plan)]
    for i in range(plan.workers):
        run.start(f"worker{i}", i, argv, _jobs.child_env({
            **common, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(i), "BYTEPS_LOCAL_RANK": "0",
            "BYTEPS_LOCAL_SIZE": "1", "DMLC_NODE_HOST": hosts.addr(i)}))
    _supervise(plan, run, progress, restart=lambda name, n: run.restart(name, BPSTRAIN_RESTART=str(n)))


def _run_torchrun(plan: Plan, hosts: EmulatedHosts, run: _Run, progress: str, faults: bool) -> None:
    port = hosts.next_port()
    checkpoint = os.path.join(run.workdir, "checkpoint.pt")
    for i in range(plan.workers):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(plan.workers),
                "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:{port}",
                "--rdzv-id", f"faults{port}", "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'}",
                "--local-addr", hosts.addr(i), "--max-restarts", "100",
                "--monitor-interval", "0.5", "-m", _WORKER, "--system", "torchrun", "--steps", str(plan.steps),
                "--progress", progress, "--checkpoint", checkpoint,
                "--checkpoint-every", str(plan.checkpoint_every), "--timeout", str(_collective_timeout(plan)),
                *_model_args(plan)]
        run.start(f"worker{i}", i, argv, _jobs.child_env({"GLOO_SOCKET_IFNAME": hosts.ifname}))
    _supervise(plan, run, progress, restart=None)


def _run_torchft(plan: Plan, hosts: EmulatedHosts, run: _Run, progress: str, faults: bool) -> None:
    lighthouse_host = plan.workers + plan.servers  # where bpstrain's scheduler runs
    port = hosts.next_port()
    # torchft's lighthouse: quorums of the replica groups that heartbeat; one that misses
    # heartbeats for --timeout is out (as the others' detection).
    run.start("lighthouse", lighthouse_host, [sys.executable, "-c", (
        "import time\nfrom torchft._torchft import LighthouseServer\n"
        f"s = LighthouseServer(bind='0.0.0.0:{port}', min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=100, "
        f"heartbeat_timeout_ms={int(plan.timeout * 1000)})\ntime.sleep(1e9)")], _jobs.child_env({}))
    for i in range(plan.workers):
        argv = [sys.executable, "-m", _WORKER, "--system", "torchft", "--rank", str(i), "--host", hosts.addr(i),
                "--steps", str(plan.steps), "--progress", progress, "--timeout", str(_collective_timeout(plan)),
                *_model_args(plan)]
        run.start(f"worker{i}", i, argv, _jobs.child_env({
            "GLOO_SOCKET_IFNAME": hosts.ifname, "TORCHFT_LIGHTHOUSE": f"http://{hosts.addr(lighthouse_host)}:{port}"}))
    _supervise(plan, run, progress, restart=lambda name, n: run.restart(name, BPSTRAIN_RESTART=str(n)))


def _supervise(plan: Plan, run: _Run, progress: str, restart) -> None:
    """Until every worker finished, or ``plan.duration`` seconds after the first step:
    restarts a bpstrain worker that failed (``restart``); a torchrun agent restarts its own."""
    deadline = time.monotonic() + plan.run_timeout
    restarts = 0
    handled = set()
    first = 0.0
    while True:
        if plan.duration:
            first = first or _first_step_at(progress)
            if first and time.time() > first + plan.duration + 0.5:
                _log(f"trained {plan.duration:.0f} s: stopped")
                return
        workers = {n: p for n, p in run.procs.items() if n.startswith("worker")}
        codes = {n: p.poll() for n, p in workers.items()}
        if None not in codes.values():
            if 0 not in codes.values():
                raise _jobs.BenchError(f"no worker finished: {codes}\n{run.logs('worker0')[-3000:]}")
            return
        for name, code in codes.items():
            if code in (None, 0) or id(workers[name]) in handled:
                continue
            handled.add(id(workers[name]))
            if restart is None:
                raise _jobs.BenchError(f"{name} failed (exit code {code}):\n{run.logs(name)[-3000:]}")
            if 0 in codes.values():  # the others finished training: nobody left to rejoin
                _log(f"{name} exited with code {code} after the others finished")
                continue
            restarts += 1
            _log(f"{name} exited with code {code}; started again")
            restart(name, restarts)
        if time.monotonic() > deadline:
            raise _jobs.BenchError(f"the run did not finish within {plan.run_timeout:.0f} s")
        time.sleep(0.1)


def _read_progress(directory: str) -> tuple[list, list]:
    """(step lines as (time, step, workers, file), notes as (time, text, file))."""
    steps, notes = [], []
    for path in glob.glob(os.path.join(directory, "*")):
        name = os.path.basename(path)
        for line in open(path):
            if line.startswith("# "):
                t, text = line[2:].split(" ", 1)
                notes.append((float(t), text.strip(), name))
            elif line.strip():
                step, t, workers = line.split()
                steps.append((float(t), int(step), int(workers), name))
    return sorted(steps), sorted(notes)


def _within(steps: list, notes: list, duration: float) -> tuple[list, list]:
    """The steps and notes of the first ``duration`` seconds from the first step (what a
    run stopped then trained; steps completing as it was stopped are not counted)."""
    if not steps:
        return steps, notes
    end = steps[0][0] + duration
    return [s for s in steps if s[0] <= end], [n for n in notes if n[0] <= end]


def _summarize(system: str, steps: list, notes: list, injected: Sequence[Injected], accuracy: float,
               batch: int = MODELS["digits_cnn"], duration: float = 0.0) -> dict:
    """Per event: noticed, stall, steps lost, back; per run: samples/s that count
    (``batch`` samples per worker and step). ``duration``: a run stopped that long after
    its first step (``steps`` as :func:`_within` keeps them), counted over its whole window:
    samples per second of the window, events up to its end, and a pause that lasts until
    it (a restart still under way) as a stall."""
    first = steps[0][0]
    last = first + duration if duration else steps[-1][0]
    final = max(s for _, s, _, _ in steps)
    if system != "torchrun":  # the groups that took part in each step
        per_step = {}
        for _, s, w, _ in steps:
            per_step[s] = w
        samples = sum(per_step.values()) * batch
    else:
        samples = final * len({n.split("-")[1] for _, _, _, n in steps}) * batch
    events = []
    # An event after the last step hit a job that had finished training (its workers
    # still exiting): nothing to measure.
    injected = [ev for ev in injected if ev.at < last]
    ends = [ev.at for ev in injected[1:]] + [last]
    for ev, until in zip(injected, ends):
        after = [(t, s) for t, s, _, _ in steps if t > ev.at]
        # Steps lost: those a rank completed before the event and computed again after it
        # (a restart from a checkpoint); a rank finishing the step in flight loses none.
        done_before: dict = {}
        for t, s, _, n in steps:
            if t < ev.at:
                done_before.setdefault(n.split("-")[1], set()).add(s)
        redone = {}
        for t, s, _, n in steps:
            if t > ev.at and s in done_before.get(n.split("-")[1], ()):
                redone.setdefault(n.split("-")[1], set()).add(s)
        lost = max((len(v) for v in redone.values()), default=0)
        # torchft: a step whose allreduce failed is not committed and computed again.
        uncommitted: dict = {}
        for t, text, n in notes:
            if ev.at < t <= until and text.startswith("uncommitted"):
                uncommitted[n.split("-")[1]] = uncommitted.get(n.split("-")[1], 0) + 1
        lost += max(uncommitted.values(), default=0)
        # The stall: the longest pause between two steps completed (by anyone) from the
        # event to the next one; a step in flight when a worker hangs waits for detection.
        until = max(until, after[0][0] if after else until)
        times = [ev.at] + sorted({t for t, _, _, _ in steps if ev.at < t <= until})
        if duration and until >= last:
            times.append(last)
        stall = max((b - a for a, b in zip(times, times[1:])), default=float("nan"))
        if system != "torchrun" and ev.kind == "server":  # a worker finished a step after the move
            noticed = [t for t, text, _ in notes if t > ev.at and text.startswith("servers lost")]
        elif system != "torchrun":
            noticed = [t for t, text, n in notes if t > ev.at and text.startswith("membership")
                       and not n.startswith(f"{system}-{ev.host}-")]
        else:  # a worker process of the restart began
            noticed = [t for t, text, _ in notes if t > ev.at and text.startswith("launched")]
        # The victim trains again. torchrun: any process of the restart (every worker
        # restarts); the others: a step of the victim's host (bpstrain and torchft start a
        # killed worker again; a stopped or cut-off one bpstrain declared gone exits and is
        # started again, torchft's own heals and rejoins). Half a second after the event
        # at least: a step the victim had finished on the wire may still land.
        if system == "torchrun":
            fresh = {n for t, text, n in notes if t > ev.at and text.startswith("start")}
            back = [t for t, _, _, n in steps if n in fresh]
        elif ev.kind != "server":
            back = [t for t, _, _, n in steps if t > ev.at + 0.5 and n.startswith(f"{system}-{ev.host}-")]
        else:
            back = []
        events.append({"event": ev.kind, "host": ev.host, "at_s": ev.at - first,
                       "noticed_s": (noticed[0] - ev.at) if noticed else None, "stall_s": stall,
                       "steps_lost": lost,
                       "back_s": (back[0] - ev.at) if back else None})
    return {"system": system, "seconds": last - first, "steps": final, "samples": samples,
            "samples_per_s": samples / max(last - first, 1e-9), "accuracy": accuracy, "events": events}


def run_system(plan: Plan, cluster: emulated.EmulatedCluster, hosts: EmulatedHosts, system: str,
               faults: bool) -> dict:
    """One run of ``system``, with the fault schedule or without; its summary."""
    with tempfile.TemporaryDirectory(prefix="bpsfaults") as tmp:
        workdir = tmp
        if plan.keep:  # the processes' output and progress files, for a look afterwards
            workdir = os.path.join(plan.keep, f"{system}-{'faults' if faults else 'clean'}")
            os.makedirs(workdir, exist_ok=True)
        progress = os.path.join(workdir, "progress")
        run, injected, done = _Run(hosts, workdir), [], threading.Event()
        injector = threading.Thread(target=_inject, args=(plan, run, cluster, system, progress, done, injected),
                                    daemon=True)
        if faults:
            injector.start()
        try:
            {"bpstrain": _run_bpstrain, "torchrun": _run_torchrun, "torchft": _run_torchft}[system](
                plan, hosts, run, progress, faults)
        finally:
            done.set()
            if faults:
                injector.join()
            with open(os.path.join(workdir, "events.json"), "w") as f:  # with --keep: to summarize again
                json.dump([dataclasses.asdict(e) for e in injected], f)
            time.sleep(0.5)
            run.kill_all()
            for i in range(cluster.num_hosts):  # a cut link must not outlive its run
                subprocess.run(["ip", "netns", "exec", cluster.netns(i), "ip", "link", "set", cluster.ifname,
                                "up"], check=False)
        results = [json.loads(m) for m in re.findall(r"FAULTS_RESULT (.*)", "".join(
            run.logs(n) for n in run.procs if n.startswith("worker")))]
        steps, notes = _read_progress(progress)
        if plan.duration:
            steps, notes = _within(steps, notes, plan.duration)
            results = []  # stopped, not finished: no final accuracy
        return _summarize(system, steps, notes, injected, results[-1]["accuracy"] if results else float("nan"),
                          MODELS[plan.model], plan.duration)


def _failure(exc: Exception) -> str:
    """One line for a run that failed: what failed, and the last line of its log (the error)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0].rstrip(":") + (f": {lines[-1]}" if len(lines) > 1 else "")


def run(plan: Plan, on_summary=None) -> list[dict]:
    """Every system without faults, then with them; their summaries. A run that fails
    (a peer's job that gives up) is a summary with ``failed``, and the others go on.
    ``on_summary(summaries)`` is called after each run (to keep what is done)."""
    for kind in plan.events:
        if kind not in EVENTS:
            raise ValueError(f"events are {', '.join(EVENTS)}. Received: {kind!r}")
    if "torchft" in plan.systems and importlib.util.find_spec("torchft") is None:
        raise ValueError("the torchft peer needs torchft (pip install torchft==0.2.0); or leave it out with "
                         "--systems bpstrain torchrun")
    if sum(kind == "server" for kind in plan.events) >= plan.servers:
        raise ValueError(f"each 'server' event kills one of the {plan.servers} servers and one must stay. "
                         f"Received: events={list(plan.events)}")
    out = []
    with emulated.EmulatedCluster(plan.workers + plan.servers + 1, plan.rate_mbit) as cluster:
        hosts = EmulatedHosts(cluster)
        for system in plan.systems:
            for faults in (False, True):
                _log(f"{system}, {'with' if faults else 'without'} faults")
                try:
                    summary = run_system(plan, cluster, hosts, system, faults)
                except _jobs.BenchError as exc:
                    summary = {"system": system, "events": [], "failed": _failure(exc)}
                    _log(f"  failed: {summary['failed']}")
                else:
                    _log(f"  {summary['steps']} steps in {summary['seconds']:.1f} s, "
                         f"accuracy {summary['accuracy']:.3f}")
                summary["faults"] = faults
                out.append(summary)
                if on_summary is not None:
                    on_summary(out)
    return out


def format_tables(summaries: Sequence[dict]) -> str:
    lines = ["| system | event | at (s) | others noticed (s) | stall (s) | steps lost | victim back (s) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    for s in summaries:
        for e in s["events"]:
            lines.append(f"| {s['system']} | {e['event']} host {e['host']} | {e['at_s']:.1f} | {fmt(e['noticed_s'])} "
                         f"| {fmt(e['stall_s'])} | {e['steps_lost']} | {fmt(e['back_s'])} |")
    lines += ["", "| system | samples/s, no faults | samples/s, faults | goodput | accuracy, no faults "
              "| accuracy, faults |", "|---|---:|---:|---:|---:|---:|"]
    for system in dict.fromkeys(s["system"] for s in summaries):
        clean = next((s for s in summaries if s["system"] == system and not s["faults"]), None)
        hit = next((s for s in summaries if s["system"] == system and s["faults"]), None)
        if clean and hit and ("failed" in clean or "failed" in hit):
            cells = [f"failed: {s['failed']}" if "failed" in s else "–" for s in (clean, hit)]
            lines.append(f"| {system} | {cells[0]} | {cells[1]} | – | – | – |")
        elif clean and hit:
            rate = lambda v: f"{v:.0f}" if v >= 100 else f"{v:.2f}"  # noqa: E731 (VGG-16: a few per second)
            acc = lambda v: "–" if v != v else f"{v:.3f}"  # noqa: E731 (nan: a --duration run, stopped)
            lines.append(f"| {system} | {rate(clean['samples_per_s'])} | {rate(hit['samples_per_s'])} | "
                         f"{hit['samples_per_s'] / clean['samples_per_s']:.2f} | {acc(clean['accuracy'])} | "
                         f"{acc(hit['accuracy'])} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Plan()
    p.add_argument("--workers", type=int, default=d.workers, help="worker hosts")
    p.add_argument("--servers", type=int, default=d.servers, help="server hosts (bpstrain)")
    p.add_argument("--rate-mbit", type=float, default=d.rate_mbit)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--duration", type=float, default=d.duration,
                   help="seconds of training per run from its first step, then it is stopped (0: until --steps, "
                        "which is then a ceiling): the goodput over a fixed time")
    p.add_argument("--events", nargs="+", default=list(d.events), choices=EVENTS)
    p.add_argument("--every", type=float, default=d.every, help="seconds between events")
    p.add_argument("--stop-s", type=float, default=d.stop_s)
    p.add_argument("--cut-s", type=float, default=d.cut_s)
    p.add_argument("--timeout", type=float, default=d.timeout,
                   help="detection: bpstrain's comm.timeout, torchft's heartbeat timeout, and gloo's timeout (s)")
    p.add_argument("--collective-timeout", type=float, default=d.collective_timeout,
                   help="torchrun's and torchft's gloo timeout when it must be longer than --timeout "
                        "(a big model's allreduce; 0 = --timeout)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="torchrun")
    p.add_argument("--model", default=d.model, choices=sorted(MODELS),
                   help="what the workers train: the digits CNN, or VGG-16 (134 M parameters) on the same digits")
    p.add_argument("--run-timeout", type=float, default=d.run_timeout, help="seconds one run may take")
    p.add_argument("--systems", nargs="+", default=list(d.systems), choices=("bpstrain", "torchrun", "torchft"))
    p.add_argument("--json", help="also write the summaries here")
    p.add_argument("--keep", default="", help="keep each run's logs and progress files in this directory")
    args = p.parse_args(argv)
    ok, reason = emulated.available()
    if not ok:
        print(f"faults benchmark: {reason}", file=sys.stderr)
        return 2
    plan = Plan(workers=args.workers, servers=args.servers, rate_mbit=args.rate_mbit, steps=args.steps,
                events=args.events, every=args.every, stop_s=args.stop_s, cut_s=args.cut_s,
                timeout=args.timeout, checkpoint_every=args.checkpoint_every, systems=args.systems,
                keep=args.keep, model=args.model, run_timeout=args.run_timeout,
                collective_timeout=args.collective_timeout, duration=args.duration)
    def keep(summaries):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summaries, f, indent=1)

    print(format_tables(run(plan, on_summary=keep)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
