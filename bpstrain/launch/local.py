"""One-host clusters: scheduler + servers as child processes, plus worker commands.

Example (notebook / benchmark)::

    from bpstrain.launch import LocalServices

    with LocalServices(workers=2, servers=1) as services:
        procs = [subprocess.Popen(cmd, env=services.worker_env(i)) for i in range(2)]
        ...
        services.check()  # raises PeerError if the scheduler or a server died

Example (what ``python -m bpstrain.launch`` does)::

    code = launch_local(["python", "train.py"], workers=4, servers=2, local_size=2)
"""

from __future__ import annotations

import atexit
import os
import queue
import random
import secrets
import socket
import sys
import threading
from pathlib import Path
from typing import Mapping, Sequence, TextIO

from bpstrain.errors import ConfigError, PeerError
from bpstrain.roles import SERVE_NEXT_JOB_VAR
from bpstrain.launch._join import JOIN_FILE_VAR, remove_join_file, write_join_file
from bpstrain.launch._procs import (DEFAULT_GRACE, Child, exit_code, log, stop_children,
                                    supervise)

_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
_PER_PROCESS_VARS = ("DMLC_ROLE", "DMLC_WORKER_ID", "DMLC_SERVER_ID", "BYTEPS_LOCAL_RANK",
                     "BPSTRAIN_HOST_ID",
                     "BYTEPS_LOCAL_SIZE", "BPSTRAIN_LAUNCH_PARENT")


_PORT_RANGE = (20000, 32000)  # below Linux's ephemeral range (32768-60999)


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port on ``host`` that was free a moment ago.

    Ports come from below the kernel's ephemeral range: a port the OS hands out for
    ``bind(0)`` can be taken a moment later as the local port of some outgoing
    connection, and the scheduler would then fail to listen on it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*_PORT_RANGE)
        with socket.socket(family) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as sock:  # everything we tried is busy: let the OS pick
        sock.bind((host, 0))
        return sock.getsockname()[1]


def role_process_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a scheduler or server process that this process starts and owns."""
    env = dict(env)
    # Role processes must import the same bpstrain as we do, even when it is
    # only on our sys.path (e.g. a notebook next to a source checkout). An
    # installed copy is found anyway; putting site-packages first would let
    # stale backports there shadow the standard library.
    if Path(_PACKAGE_PARENT).name not in ("site-packages", "dist-packages"):
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = _PACKAGE_PARENT + (os.pathsep + path if path else "")
    if threading.current_thread() is threading.main_thread():
        # Lets the role arm PR_SET_PDEATHSIG; only from the main thread, since
        # the signal fires when the *thread* that forked exits.
        env["BPSTRAIN_LAUNCH_PARENT"] = str(os.getpid())
    return env


def check_layout(workers: int, servers: int, local_size: int | None,
                 min_servers: int = 1) -> int:
    """Validates a local cluster's shape and returns the effective local size.

    Args:
        workers: Number of worker processes (``DMLC_NUM_WORKER * BYTEPS_LOCAL_SIZE``).
        servers: Number of dedicated summation servers.
        local_size: Workers per emulated host; ``None`` means all on one host.
        min_servers: 0 when mixed mode adds servers on the worker hosts.

    Raises:
        ConfigError: (a ``ValueError``) When a count is not positive or ``workers`` is not a
            multiple of ``local_size``.
    """
    for name, value, low in (("workers", workers, 1), ("servers", servers, min_servers)):
        if not isinstance(value, int) or value < low:
            what = "a positive integer" if low else "an integer >= 0"
            raise ConfigError(f"{name} must be {what}. Received: {name}={value!r}")
    if local_size is None:
        return workers
    if not isinstance(local_size, int) or local_size < 1 or workers % local_size:
        raise ConfigError(
            "local_size must be a positive integer that divides workers (each host "
            f"runs local_size workers). Received: workers={workers}, local_size={local_size!r}")
    return local_size


class LocalServices:
    """Scheduler and ``servers`` servers for ``workers`` workers, as child processes.

    Use as a context manager, or call :meth:`start` / :meth:`stop`. Services run
    in their own process groups, are stopped at interpreter exit (atexit) and,
    when started from the main thread, get SIGTERM if this process dies. They
    exit on their own once every worker shut down: call :meth:`wait` before
    :meth:`stop` for a clean end, :meth:`check` while workers run.

    Args:
        workers: Number of worker processes that will join.
        servers: Number of dedicated summation servers to start.
        local_size: Workers per emulated host (``BYTEPS_LOCAL_SIZE``); default all.
            Workers of one emulated host share a ``BPSTRAIN_HOST_ID``.
        mixed: Also start one server on every emulated worker host (BytePS's mixed
            mode; the scheduler then splits the keys between co-located and dedicated
            servers). ``None`` = when there are fewer dedicated servers than worker
            hosts; with ``True``, ``servers`` may be 0.
        host: Address the scheduler listens on and every node binds to.
        port: Scheduler port; a free one is picked when ``None``.
        env: Extra variables for every process, over ``os.environ``.
        output: Stream for the prefixed service output; ``None`` = ``sys.stdout``.
        grace: Seconds between SIGTERM and SIGKILL in :meth:`stop`.
        on_exit: Called (from a thread) with each service :class:`Child` as it exits.
        serve_next_job: The services start afresh each time the job's workers have all
            shut down, so a worker that calls ``init()`` again after ``shutdown()``
            joins a new job; they then never exit on their own (:meth:`wait` does not
            return True) and the owner stops them once its workers have exited (what
            the launcher does).

    Attributes:
        role_cmd: Command that runs a role given ``DMLC_ROLE`` in its environment.
            Tests replace it with a fake role.
    """

    role_cmd: Sequence[str] = (sys.executable, "-m", "bpstrain.launch")

    def __init__(self, workers: int, servers: int = 1, local_size: int | None = None,
                 host: str = "127.0.0.1", port: int | None = None,
                 env: Mapping[str, str] | None = None, output: TextIO | None = None,
                 grace: float = DEFAULT_GRACE, on_exit=None, mixed: bool | None = None,
                 serve_next_job: bool = False):
        self.local_size = check_layout(workers, servers, local_size, 0 if mixed else 1)
        self.workers, self.servers, self.host = workers, servers, host
        self.hosts = workers // self.local_size
        self.mixed = self.hosts > servers if mixed is None else bool(mixed)
        self.total_servers = servers + (self.hosts if self.mixed else 0)
        self.port = port
        self.grace = grace
        self.children: list[Child] = []
        base = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        # A launcher started inside another job must not hand its own identity on.
        self._env = {k: v for k, v in base.items() if k not in _PER_PROCESS_VARS}
        # Every process of a local job is ours, so it gets a fresh cluster secret unless
        # the user chose one: no other process on this machine can join, push into or
        # read the job (see the README's threat model).
        if not self._env.get("BPSTRAIN_SECRET"):
            self._env["BPSTRAIN_SECRET"] = secrets.token_hex(32)
        self.serve_next_job = serve_next_job
        self._output, self._on_exit = output, on_exit

    def _common_env(self, role: str) -> dict[str, str]:
        if self.port is None:
            raise RuntimeError("LocalServices is not started: call start() or use `with`.")
        # BytePS's rule: DMLC_NUM_WORKER counts hosts of local_size processes each.
        return {**self._env, "DMLC_ROLE": role,
                "DMLC_NUM_WORKER": str(self.hosts), "BYTEPS_LOCAL_SIZE": str(self.local_size),
                "DMLC_NUM_SERVER": str(self.total_servers), "DMLC_PS_ROOT_URI": self.host,
                "DMLC_PS_ROOT_PORT": str(self.port), "DMLC_NODE_HOST": self.host}

    def worker_env(self, i: int) -> dict[str, str]:
        """The complete environment (``os.environ`` + ``env`` + cluster) for worker ``i``.

        Args:
            i: Global rank, ``0 <= i < workers``.
        """
        if not 0 <= i < self.workers:
            raise ConfigError(f"worker index must be in [0, {self.workers}). Received: i={i!r}")
        env = {**self._common_env("worker"), "DMLC_WORKER_ID": str(i // self.local_size),
               "BYTEPS_LOCAL_RANK": str(i % self.local_size),
               "BYTEPS_LOCAL_SIZE": str(self.local_size)}
        return self._on_host(env, i // self.local_size)

    def _on_host(self, env: dict[str, str], host: int | None) -> dict[str, str]:
        # Emulated hosts share one address, so they are told apart by id; one host
        # needs none (everything is co-located there anyway).
        if self.hosts > 1 and host is not None:
            env["BPSTRAIN_HOST_ID"] = f"local-host-{host}"
        return env

    def _role_env(self, role: str) -> dict[str, str]:
        env = self._common_env(role)
        if self.serve_next_job:
            env[SERVE_NEXT_JOB_VAR] = "1"
        return role_process_env(env)

    def start(self) -> "LocalServices":
        """Starts the scheduler, then the servers. Returns ``self``.

        Raises:
            OSError: When the role command cannot be started.
        """
        if self.children:
            raise RuntimeError("LocalServices already started; create a new one.")
        if self.port is None:
            self.port = free_port(self.host)
        atexit.register(self.stop)
        try:
            self._spawn("scheduler", self._role_env("scheduler"))
            for s in range(self.total_servers):
                # Dedicated servers first, then one per worker host in mixed mode.
                host = s - self.servers if s >= self.servers else None
                env = {**self._role_env("server"), "DMLC_SERVER_ID": str(s)}
                if host is None:
                    env.pop("BPSTRAIN_HOST_ID", None)
                self._spawn(f"server {s}", self._on_host(env, host))
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def scheduler(self) -> Child:
        """The scheduler's child process (started first)."""
        return self.children[0]

    def _spawn(self, label: str, env: Mapping[str, str]) -> None:
        self.children.append(Child(label, self.role_cmd, env, self._on_exit, self._output))

    def check(self) -> None:
        """Raises if any service has exited.

        Raises:
            bpstrain.errors.PeerError: Naming the first service that is gone and its
                exit code.
        """
        for child in self.children:
            if child.returncode is not None:
                raise PeerError(
                    f"{child.label} of the local cluster exited with code "
                    f"{exit_code(child.returncode)}; its output above (prefixed "
                    f"[{child.label}]) says why. Start a new LocalServices to continue.")

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for every service to exit on its own (they do once all workers shut down).

        Returns:
            True when all services have exited.
        """
        for child in self.children:
            if not child.exited.wait(timeout):
                return False
        return True

    def stop(self) -> None:
        """Stops every service and its process group; idempotent."""
        atexit.unregister(self.stop)
        stop_children(self.children, self.grace)

    def __enter__(self) -> "LocalServices":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalJob:
    """A whole one-host job: :class:`LocalServices` plus ``workers`` copies of ``cmd``.

    Args:
        cmd: Worker command line.
        workers, servers, local_size, host, port, env, output, grace, mixed: As for
            :class:`LocalServices`.
        service_timeout: Seconds services may keep running after every worker
            exited 0 before they are stopped.
        max_restarts: With ``comm.fault_tolerance``: how many times in all a worker
            that exits non-zero is started again (it rejoins in its place).
    """

    def __init__(self, cmd: Sequence[str], workers: int, servers: int = 1,
                 local_size: int | None = None, host: str = "127.0.0.1",
                 port: int | None = None, env: Mapping[str, str] | None = None,
                 output: TextIO | None = None, grace: float = DEFAULT_GRACE,
                 service_timeout: float = 30.0, mixed: bool | None = None, max_restarts: int = 0):
        if not cmd:
            raise ConfigError("cmd must name the worker command. Received: cmd=[]")
        self.cmd = list(cmd)
        self._events: queue.Queue = queue.Queue()
        # The launcher's roles serve job after job: a worker may init() again after
        # shutdown() (as with Horovod); supervise() stops them when the workers are done.
        self.services = LocalServices(workers, servers, local_size, host, port, env,
                                      output, grace, on_exit=self._events.put, mixed=mixed,
                                      serve_next_job=True)
        self.workers: list[Child] = []
        self._output, self.grace, self.service_timeout = output, grace, service_timeout
        if max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0. Received: {max_restarts}")
        self.max_restarts, self.restarts = int(max_restarts), 0
        self._worker_extra: dict[str, str] = {}  # what every worker's environment adds

    def _fault_tolerance(self) -> bool:
        """Whether the workers run with ``comm.fault_tolerance`` (BPSTRAIN_FAULT_TOLERANCE)."""
        from bpstrain.config.env import read_env

        return bool(read_env(self.services.worker_env(0)).comm.get("fault_tolerance", False))

    def run(self) -> int:
        """Runs the job to completion; see :func:`launch_local` for the exit code."""
        try:
            return self._run()
        finally:
            join_file = self._worker_extra.get(JOIN_FILE_VAR)
            if join_file:
                remove_join_file(Path(join_file))

    def _run(self) -> int:
        try:
            self.services.start()
            tolerant = self._fault_tolerance()
            if tolerant:  # more workers can join: say how
                join_file = write_join_file(self.services.worker_env(0), self.cmd)
                self._worker_extra[JOIN_FILE_VAR] = str(join_file)
                log(f"fault tolerance: add a worker with `python -m bpstrain.launch --join {join_file}` "
                    "(it joins at the others' next state.commit())")
            for i in range(self.services.workers):
                env = {**self.services.worker_env(i), **self._worker_extra}
                self.workers.append(Child(f"worker {i}", self.cmd, env, self._events.put, self._output))
        except OSError as exc:
            log(f"could not start {exc.filename or self.cmd[0]!s}: {exc.strerror}. "
                f"Received: cmd={self.cmd}")
            stop_children([*self.workers, *self.services.children], self.grace)
            return 127
        except BaseException:
            stop_children([*self.workers, *self.services.children], self.grace)
            raise
        try:
            if self.max_restarts and not tolerant:
                log("--max-restarts needs comm.fault_tolerance (BPSTRAIN_FAULT_TOLERANCE=1): without it "
                    "a failed worker ends the job, so no worker is restarted")
            return supervise(self.workers, self.services.children, self._events,
                             self.grace, self.service_timeout, services_exit=False,
                             tolerate_worker_failures=tolerant,
                             survivable=self._survivable() if tolerant else [],
                             restart=self._restart if tolerant else None)
        finally:
            self.services.stop()

    def _survivable(self) -> list:
        """Under fault tolerance: the scheduler, and the servers when there are several (a
        lost server's partitions move to the others; the last one's loss fails the workers)."""
        return list(self.services.children) if self.services.servers > 1 else [self.services.scheduler]

    def _restart(self, child: Child) -> Child | None:
        """A new process of a failed worker (same command and rank, BPSTRAIN_RESTART=k): it
        joins the running job in its place (torchrun's --max-restarts restarts every worker)."""
        if self.restarts >= self.max_restarts:
            return None
        self.restarts += 1
        rank = self.workers.index(child)
        env = {**self.services.worker_env(rank), **self._worker_extra, "BPSTRAIN_RESTART": str(self.restarts)}
        again = Child(f"worker {rank}", self.cmd, env, self._events.put, self._output)
        self.workers[rank] = again
        return again


def launch_local(cmd: Sequence[str], workers: int, servers: int = 1,
                 local_size: int | None = None, env: Mapping[str, str] | None = None,
                 **kwargs) -> int:
    """Runs scheduler, ``servers`` servers and ``workers`` copies of ``cmd`` on this host.

    Output lines are prefixed ``[scheduler]``, ``[server k]``, ``[worker i]``. When a
    process fails, all others (and their process groups) are stopped.

    Args:
        cmd: Worker command line.
        workers: Number of worker processes.
        servers: Number of servers.
        local_size: Workers per emulated host; must divide ``workers``.
        env: Extra environment for every process.
        **kwargs: ``host``, ``port``, ``output``, ``grace``, ``service_timeout``, ``mixed``.

    Returns:
        0 when every process exited 0; else the first failing process's exit
        status (128+N for signal N); 130/143 when the launcher was interrupted;
        127 when ``cmd`` could not be started.
    """
    return LocalJob(cmd, workers, servers, local_size, env=env, **kwargs).run()
