"""``srun ... python -m bpstrain.launch --slurm -- CMD ...``: one bpstrain job per Slurm step.

Every task of the step runs this launcher; each works out its own part from Slurm's
variables, so nothing is set by hand:

* **one task per worker** (``srun -N 4 --ntasks-per-node=2 ...``): node i of the step holds
  ranks i·L … i·L+L−1 (L = tasks per node, local rank = ``SLURM_LOCALID``); the first task
  of every node also runs that node's server (BytePS's mixed mode) and the first node's
  first task also runs the scheduler;
* **one task per node** (``srun -N 4 --ntasks-per-node=1 ... --slurm --local-size 2``): each
  task starts L local workers itself (L defaults to ``SLURM_GPUS_ON_NODE`` when set);
* **a heterogeneous step** (``srun -N 4 ... : -N 2 ...``): the nodes of the first component
  run the workers as above, every task of the later components runs one dedicated server
  (components are told apart by ``SLURM_JOB_NODELIST_HET_GROUP_k``, or Slurm's older
  ``..._PACK_GROUP_k``); mixed mode stays on while there are fewer dedicated servers than
  worker nodes (``--mixed`` / ``--no-mixed`` decide otherwise).

Node names are resolved to addresses (DNS or ``/etc/hosts``); the scheduler's port comes
from the job and step ids (``--port`` overrides). When any process of a task fails, the
task stops its other processes and cancels the whole step (``scancel JOB.STEP``), so no
task waits for peers that are gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable, Mapping, Sequence

from bpstrain.errors import ConfigError
from bpstrain.launch._procs import DEFAULT_GRACE, Child, log, shield_signals, stop_children, \
    supervise
from bpstrain.launch.local import _PER_PROCESS_VARS, role_process_env

_PORT_BASE, _PORT_SPAN = 20000, 12000  # below Linux's ephemeral range, as free_port
_GROUP_VARS = ("SLURM_JOB_NODELIST_HET_GROUP_{}", "SLURM_JOB_NODELIST_PACK_GROUP_{}")
_HET_JOB_ID_VARS = ("SLURM_HET_JOB_ID", "SLURM_PACK_JOB_ID", "SLURM_JOB_ID_HET_GROUP_0",
                    "SLURM_JOB_ID_PACK_GROUP_0")


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compact host list as names: ``"node[1-3,5],gpu07"`` → node1 … node5, gpu07.

    Ranges keep their zero padding (``n[08-10]`` → n08, n09, n10) and several bracket
    groups in one name multiply out (``r[1-2]n[1-2]`` → r1n1, r1n2, r2n1, r2n2), as
    ``scontrol show hostnames`` does.

    Raises:
        ConfigError: (a ``ValueError``) on unbalanced brackets or a malformed range.
    """
    names: list[str] = []
    for item in _split_top_level(text.strip()):
        names.extend(_expand_one(item, text))
    return names


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ConfigError(f"malformed Slurm node list: unbalanced brackets. Received: {text!r}")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"malformed Slurm node list: unbalanced brackets. Received: {text!r}")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_one(item: str, whole: str) -> list[str]:
    match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not match:
        return [item]
    prefix, ranges, rest = match.groups()
    tails = _expand_one(rest, whole) if rest else [""]
    out = []
    for part in ranges.split(","):
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not bounds or (bounds[2] is not None and int(bounds[2]) < int(bounds[1])):
            raise ConfigError(f"malformed Slurm node list: bad range {part!r}. Received: {whole!r}")
        low, high = bounds[1], bounds[2] or bounds[1]
        width = len(low) if low.startswith("0") else 0
        for number in range(int(low), int(high) + 1):
            out.extend(f"{prefix}{number:0{width}d}{tail}" for tail in tails)
    return out


def expand_counts(text: str, variable: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Slurm's per-node counts: ``"2(x3),1"`` → ``[2, 2, 2, 1]``.

    Raises:
        ConfigError: naming ``variable`` when ``text`` is malformed.
    """
    counts: list[int] = []
    for part in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ConfigError(f"environment variable {variable} must be counts such as "
                              f"2(x3),1. Received: {variable}={text!r}")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts


def port_for(job_id: int, step_id: int, restart: int = 0) -> int:
    """The scheduler's port for a step: the same on every node, different per job, step and
    run of a requeued job (``SLURM_RESTART_COUNT``: the last run's scheduler may still be
    closing when the next run starts on the same nodes)."""
    return _PORT_BASE + (job_id * 16 + step_id + 7 * restart) % _PORT_SPAN


def _int_or_zero(value) -> int:
    return int(value) if value and str(value).strip().isdigit() else 0


@dataclasses.dataclass(frozen=True)
class SlurmTask:
    """What one task of the step runs, and the environment its processes share.

    Attributes:
        node: This task's node name (``SLURMD_NODENAME``).
        scheduler: Whether this task runs the scheduler.
        server_id: The server this task runs (``None``: none).
        worker_id: This node's index among the worker nodes (``None``: a server-only task).
        local_ranks: The local ranks of the workers this task starts.
        local_size: Workers per worker node (``BYTEPS_LOCAL_SIZE``).
        worker_nodes, server_nodes: Node names of the workers and dedicated servers.
        env: ``DMLC_*`` / ``BYTEPS_*`` variables common to this task's processes.
        job: ``JOB.STEP``, what ``scancel`` ends.
    """

    node: str
    scheduler: bool
    server_id: int | None
    worker_id: int | None
    local_ranks: tuple[int, ...]
    local_size: int
    worker_nodes: tuple[str, ...]
    server_nodes: tuple[str, ...]
    env: Mapping[str, str]
    job: str

    def describe(self) -> str:
        """One line for the log: which roles run here."""
        parts = (["scheduler"] if self.scheduler else []) + (
            [f"server {self.server_id}"] if self.server_id is not None else [])
        if self.worker_id is not None:
            ranks = [self.worker_id * self.local_size + r for r in self.local_ranks]
            parts.append(f"worker{'s' if len(ranks) > 1 else ''} "
                         + ", ".join(map(str, ranks)))
        return (f"Slurm step {self.job}, node {self.node}: {' + '.join(parts)} "
                f"({len(self.worker_nodes)} worker node(s) x {self.local_size}, "
                f"{self.env['DMLC_NUM_SERVER']} server(s), scheduler at "
                f"{self.env['DMLC_PS_ROOT_URI']}:{self.env['DMLC_PS_ROOT_PORT']})")


def _need(environ: Mapping[str, str], *names: str) -> tuple[str, str]:
    for name in names:
        value = (environ.get(name) or "").strip()
        if value:
            return name, value
    raise ConfigError(
        "Slurm mode (launch --slurm, or the Trainer's cluster.launcher: slurm) runs in every "
        "task of an srun step (`srun -N 4 --ntasks-per-node=2 python -m bpstrain.launch "
        f"--slurm -- python train.py`), and {names[0]} is "
        f"not set{' (nor ' + ', '.join(names[1:]) + ')' if names[1:] else ''}: this is not "
        f"a Slurm task. Received: {names[0]} unset")


def _int_var(environ: Mapping[str, str], *names: str) -> int:
    name, value = _need(environ, *names)
    if not value.isdigit():
        raise ConfigError(f"environment variable {name} must be a non-negative integer. "
                          f"Received: {name}={value!r}")
    return int(value)


def _components(environ: Mapping[str, str], step_nodes: list[str]) -> list[list[str]]:
    """The step's nodes per heterogeneous component (one component for a plain step)."""
    groups = []
    for k in range(64):
        found = [(v.format(k), environ[v.format(k)]) for v in _GROUP_VARS
                 if environ.get(v.format(k))]
        if not found:
            break
        groups.append((found[0][0], found[0][1], set(expand_nodelist(found[0][1]))))
    if len(groups) < 2:
        return [step_nodes]
    comps: list[list[str]] = [[] for _ in groups]
    for node in step_nodes:
        owners = [i for i, (_, _, names) in enumerate(groups) if node in names]
        if len(owners) > 1:
            shown = ", ".join(f"{var}={raw}" for var, raw, _ in groups)
            raise ConfigError(
                f"node {node} belongs to several components of the heterogeneous job, so "
                "its tasks cannot tell workers from servers: give each component its own "
                f"nodes. Received: {shown}")
        if owners:
            comps[owners[0]].append(node)
    comps = [c for c in comps if c]
    if not comps:
        raise ConfigError(f"no node of the step is in any component of the heterogeneous job. "
                          f"Received: {groups[0][0]}={groups[0][1]}")
    return comps


def _resolve(node: str, variable: str, resolve: Callable[[str], str]) -> str:
    try:
        return resolve(node)
    except OSError as exc:
        raise ConfigError(
            f"cannot resolve Slurm node name {node!r} (from {variable}) to an address: "
            f"{exc}. Every node's name must resolve (DNS or /etc/hosts) on every node.") \
            from None


def plan(environ: Mapping[str, str], local_size: int | None = None, port: int | None = None,
         mixed: bool | None = None,
         resolve: Callable[[str], str] = socket.gethostbyname,
         rank_per_task: bool = False) -> SlurmTask:
    """Works out this task's part of the job from Slurm's variables.

    Args:
        environ: The task's environment.
        local_size: ``--local-size``: workers this task starts (one task per node only).
        port: ``--port``: the scheduler's port; default :func:`port_for` the job and step.
        mixed: ``--mixed``: a server on every worker node; ``None`` = when there are
            fewer dedicated servers than worker nodes.
        resolve: Node name to address.
        rank_per_task: Every task is exactly one worker (the Trainer in the task itself):
            no local size from the GPU variables.

    Raises:
        ConfigError: When the allocation cannot form a job; the message names the variable.
    """
    het_id = [environ[v] for v in _HET_JOB_ID_VARS if (environ.get(v) or "").isdigit()]
    job_id = int(het_id[0]) if het_id else _int_var(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    step_name, step_raw = next(((n, environ[n].strip()) for n in ("SLURM_STEP_ID",
                                "SLURM_STEPID") if (environ.get(n) or "").strip()),
                               ("SLURM_STEP_ID", ""))
    if not step_raw.isdigit():
        received = f"{step_name}={step_raw!r}" if step_raw else "SLURM_STEP_ID unset"
        raise ConfigError(
            "--slurm runs in the tasks of an srun step, not in the batch script or an "
            "salloc shell itself: start it with `srun ... python -m bpstrain.launch --slurm "
            f"-- CMD`. Received: {received}")
    local_id = _int_var(environ, "SLURM_LOCALID")
    _, node = _need(environ, "SLURMD_NODENAME")
    nodes_var, nodes_raw = _need(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                 "SLURM_NODELIST")
    step_nodes = expand_nodelist(nodes_raw)
    counts_var, counts_raw = _need(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    counts = expand_counts(counts_raw, counts_var)
    if len(counts) != len(step_nodes) or len(set(step_nodes)) != len(step_nodes):
        raise ConfigError(f"{counts_var} must give one count per node of {nodes_var}. "
                          f"Received: {counts_var}={counts_raw!r}, {nodes_var}={nodes_raw!r}")
    if node not in step_nodes:
        raise ConfigError(f"this task's node SLURMD_NODENAME={node!r} is not in the step's "
                          f"nodes. Received: {nodes_var}={nodes_raw!r}")
    per_node = dict(zip(step_nodes, counts))
    comps = _components(environ, step_nodes)
    workers, servers = comps[0], [n for comp in comps[1:] for n in comp]
    tasks = {per_node[n] for n in workers}
    if len(tasks) != 1:
        shown = ", ".join(f"{n}: {per_node[n]}" for n in workers)
        raise ConfigError(
            f"every worker node must run the same number of tasks (BytePS's local size), "
            f"e.g. srun --ntasks-per-node=2. Received: {counts_var}={counts_raw!r} ({shown})")
    tasks_per_node = tasks.pop()
    if local_size is not None and tasks_per_node != 1:
        raise ConfigError(
            "--local-size L starts L workers in each task: run one task per node "
            f"(srun --ntasks-per-node=1), or leave --local-size out for one task per worker. "
            f"Received: --local-size={local_size}, {counts_var}={counts_raw!r}")
    if local_size is None and tasks_per_node == 1 and not rank_per_task:
        gpus = environ.get("SLURM_GPUS_ON_NODE", "").strip()
        local_size = int(gpus) if gpus.isdigit() and int(gpus) > 0 else None
    size = local_size or tasks_per_node
    dedicated = sum(per_node[n] for n in servers)
    mixed = len(servers) < len(workers) if mixed is None else mixed
    if not mixed and not dedicated:
        raise ConfigError("--no-mixed leaves the job without a server: a heterogeneous step's "
                          "later components run the servers (srun ... : -N 2 ...). "
                          f"Received: {nodes_var}={nodes_raw!r}")
    root = workers[0]
    env = {"DMLC_NUM_WORKER": str(len(workers)), "BYTEPS_LOCAL_SIZE": str(size),
           "DMLC_NUM_SERVER": str(dedicated + (len(workers) if mixed else 0)),
           "DMLC_PS_ROOT_URI": _resolve(root, nodes_var, resolve),
           "DMLC_PS_ROOT_PORT": str(port or port_for(job_id, int(step_raw),
                                                     _int_or_zero(environ.get("SLURM_RESTART_COUNT")))),
           "BPSTRAIN_HOST_ID": node}
    if not (environ.get("DMLC_INTERFACE") or "").strip():
        env["DMLC_NODE_HOST"] = _resolve(node, nodes_var, resolve)
    if node in servers:
        first = sum(per_node[n] for n in servers[:servers.index(node)])
        return SlurmTask(node, False, first + local_id, None, (), size, tuple(workers),
                         tuple(servers), env, f"{job_id}.{step_raw}")
    index = workers.index(node)
    lead = local_id == 0
    return SlurmTask(node, lead and index == 0, dedicated + index if lead and mixed else None,
                     index, tuple(range(size)) if local_size else (local_id,), size,
                     tuple(workers), tuple(servers), env, f"{job_id}.{step_raw}")


def _base_env(task: SlurmTask, environ: Mapping[str, str]) -> dict[str, str]:
    base = {k: v for k, v in environ.items() if k not in _PER_PROCESS_VARS}
    base.update(task.env, PYTHONUNBUFFERED="1")
    return base


def _start_services(task: SlurmTask, base: Mapping[str, str], into: list,
                    on_exit: Callable | None = None) -> None:
    """Starts this task's scheduler and server (those it has), appending them to ``into``."""
    role_cmd = (sys.executable, "-m", "bpstrain.launch")
    if task.scheduler:
        into.append(Child("scheduler", role_cmd,
                          role_process_env({**base, "DMLC_ROLE": "scheduler"}), on_exit))
    if task.server_id is not None:
        env = {**base, "DMLC_ROLE": "server", "DMLC_SERVER_ID": str(task.server_id)}
        into.append(Child(f"server {task.server_id}", role_cmd, role_process_env(env), on_exit))


def _cancel_step(job: str, why: str) -> None:
    """Ends every task of the step (the failed one has already stopped its processes)."""
    log(f"{why}; cancelling Slurm step {job} so that no other task waits for it")
    with shield_signals():  # scancel signals this task too; let it finish its exit
        try:
            subprocess.run(["scancel", job], stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log(f"scancel {job} failed ({exc}); the other tasks end once they lose this one")


def _forward(sig: int, children: Sequence[Child]) -> None:
    """Sends ``sig`` to each child process itself (not its group: a helper process of a
    worker may not expect it)."""
    for child in children:
        if child.running():
            try:
                os.kill(child.pid, sig)
            except ProcessLookupError:
                pass


def run_task(task: SlurmTask, cmd: Sequence[str], environ: Mapping[str, str],
             grace: float = DEFAULT_GRACE, service_timeout: float | None = None) -> int:
    """Runs this task's roles and workers until the job ends.

    Returns:
        0 when every process exited 0, else the first failure's exit status (after the
        step was cancelled); 128+N when the task got signal N.
    """
    events: queue.Queue = queue.Queue()
    base = _base_env(task, environ)
    services: list[Child] = []
    workers: list[Child] = []
    log(task.describe())
    main = threading.current_thread() is threading.main_thread()
    if main:
        # `#SBATCH --signal=USR1@T` signals every process of the step; by default it would
        # kill them. Ignored while the roles and workers start (they inherit that); a
        # worker that wants it (the Trainer, to checkpoint and requeue) installs its own
        # handler.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        _start_services(task, base, services, events.put)
        for local_rank in task.local_ranks:
            rank = task.worker_id * task.local_size + local_rank
            env = {**base, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(task.worker_id),
                   "BYTEPS_LOCAL_RANK": str(local_rank)}
            workers.append(Child(f"worker {rank}", cmd, env, events.put, die_with_parent=True))
        if main:
            # Then passed on to the workers (only): each leads its own session, which a
            # site's process tracking by process group (proctrack/pgid) would not reach.
            signal.signal(signal.SIGUSR1, lambda *_: _forward(signal.SIGUSR1, workers))
    except OSError as exc:
        log(f"could not start {exc.filename or cmd[0]!s}: {exc.strerror}. Received: cmd={cmd}")
        stop_children([*workers, *services], grace)
        _cancel_step(task.job, f"node {task.node} could not start its processes")
        return 127
    except BaseException:
        stop_children([*workers, *services], grace)
        raise
    timeout = float("inf") if service_timeout is None else service_timeout
    code = supervise(workers, services, events, grace, timeout, services_exit=True)
    if code not in (0, 128 + signal.SIGTERM, 128 + signal.SIGINT):
        _cancel_step(task.job, f"a process on node {task.node} failed (exit code {code})")
    return code


def launch_slurm(cmd: Sequence[str], environ: Mapping[str, str] | None = None,
                 local_size: int | None = None, port: int | None = None,
                 mixed: bool | None = None, grace: float = DEFAULT_GRACE,
                 service_timeout: float | None = None) -> int:
    """Runs this Slurm task's part of the job (see the module docstring).

    Raises:
        ConfigError: When the Slurm allocation cannot form a job.
    """
    environ = os.environ if environ is None else environ
    task = plan(environ, local_size, port, mixed)
    return run_task(task, cmd, environ, grace, service_timeout)


def in_srun_step(environ: Mapping[str, str] | None = None) -> bool:
    """True in a task of an srun step of more than one task (what ``auto`` takes for Slurm)."""
    environ = os.environ if environ is None else environ
    step = (environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or "").strip()
    tasks = (environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "").strip()
    return (step.isdigit() and bool(environ.get("SLURM_LOCALID"))
            and tasks.isdigit() and int(tasks) > 1)


@contextlib.contextmanager
def rank_in_this_process(grace: float = DEFAULT_GRACE):
    """This srun task as one worker rank of the step's job, in this very process.

    What the Trainer does under ``srun python train.py`` (``cluster.launcher: slurm``, or
    ``auto`` in a step of several tasks): this task starts the scheduler and server that
    Slurm's placement gives it (as :func:`launch_slurm` would) and sets the worker's
    ``DMLC_*`` variables in ``os.environ`` for ``bpstrain.engine.init``. On leaving, it
    waits for its roles to end (they do once every worker has shut down) and restores the
    environment; when the body raises, it stops them and cancels the step.

    Yields:
        The :class:`SlurmTask`.

    Raises:
        ConfigError: When the Slurm allocation cannot form a job.
        bpstrain.errors.PeerError: When this task's scheduler or server failed.
    """
    from bpstrain.errors import PeerError

    task = plan(os.environ, rank_per_task=True)
    if task.worker_id is None:
        raise ConfigError(
            f"node {task.node} is in a server component of a heterogeneous step, which "
            "the Trainer cannot serve from inside the training script: start the step with "
            "`srun ... python -m bpstrain.launch --slurm -- python train.py`")
    services: list[Child] = []
    saved = dict(os.environ)
    usr1 = None
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        usr1 = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # as run_task: --signal kills not
    try:
        _start_services(task, _base_env(task, os.environ), services)
        os.environ.update(task.env, DMLC_ROLE="worker", DMLC_WORKER_ID=str(task.worker_id),
                          BYTEPS_LOCAL_RANK=str(task.local_ranks[0]))
        yield task
        for child in services:  # they end once every worker of the job has shut down
            child.wait(None)
        failed = [c for c in services if c.returncode]
        if failed:
            raise PeerError(f"{failed[0].label} on node {task.node} exited with code "
                            f"{failed[0].returncode}; its output above says why")
    except BaseException as exc:
        stop_children(services, grace)
        if not isinstance(exc, KeyboardInterrupt):
            _cancel_step(task.job, f"training on node {task.node} failed ({exc!r:.200})")
        raise
    finally:
        stop_children(services, grace)
        os.environ.clear()
        os.environ.update(saved)
        if usr1 is not None:
            signal.signal(signal.SIGUSR1, usr1)
