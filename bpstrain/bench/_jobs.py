"""Start one benchmark job (gloo ranks, or scheduler + servers + workers) and collect it.

A job is a set of processes on ``Hosts``. Workers print a ``BENCH_RESULT``
line; scheduler and servers exit by themselves once every worker has shut
down. If any process fails or the deadline passes, every process of the job
(and its process group) is stopped by the launcher's teardown
(:func:`bpstrain.launch._procs.stop_children`) and ``BenchError`` carries the tail of
each failed process's stderr.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from bpstrain.bench import _report, _teardown
from bpstrain.bench._hosts import Hosts
from bpstrain.launch._procs import Watched, stop_children

# The package root, so children import this very bpstrain even when it is not installed.
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ROLE_GRACE_S = 30.0
_KILL_GRACE_S = 3.0  # SIGTERM to SIGKILL when a failed job is torn down


class BenchError(RuntimeError):
    """A benchmark job failed or did not finish in time."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which host runs what in a bpstrain job.

    Each of ``worker_hosts`` runs ``local_size`` worker processes (BytePS's
    ``BYTEPS_LOCAL_SIZE``); worker ``i * local_size + j`` is local rank ``j`` of
    ``worker_hosts[i]`` and gets ``DMLC_WORKER_ID=i``. ``server_hosts`` run the
    dedicated servers; with ``colocated`` every worker host runs one more server
    (mixed mode: the scheduler sees the shared address and splits the keys).
    """

    worker_hosts: Sequence[int]
    server_hosts: Sequence[int]
    scheduler_host: int
    local_size: int = 1
    colocated: bool = False

    @property
    def num_servers(self) -> int:
        """Servers of the job, dedicated and co-located."""
        return len(self.server_hosts) + (len(self.worker_hosts) if self.colocated else 0)


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without cluster variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "GLOO_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_ROOT, env.get("PYTHONPATH")) if p)
    # Two cores are shared by every process of the job: keep each to one thread.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_gloo(hosts: Hosts, worker_hosts: Sequence[int], cases: Sequence[_report.Case],
             timeout_s: float) -> list[dict]:
    """Runs the gloo all-reduce benchmark, rank i on ``worker_hosts[i]``.

    Returns:
        The per-rank ``BENCH_RESULT`` payloads.
    """
    port = hosts.next_port()
    root = hosts.addr(worker_hosts[0])
    argv = [sys.executable, "-m", "bpstrain.bench._gloo_worker", "--addr", root,
            "--port", str(port), "--world-size", str(len(worker_hosts)),
            "--ifname", hosts.ifname, "--timeout", str(timeout_s),
            *_case_args(cases)]
    job = Job(hosts)
    for rank, host in enumerate(worker_hosts):
        job.start(f"gloo-rank{rank}", host, [*argv, "--rank", str(rank)], child_env({}),
                  worker=True)
    return job.collect(timeout_s)


def run_bpstrain(hosts: Hosts, layout: Layout, cases: Sequence[_report.Case],
                 timeout_s: float, partition_bytes: int | None = None,
                 extra_env: dict[str, str] | None = None) -> list[dict]:
    """Runs scheduler, servers and workers of one bpstrain push_pull benchmark.

    Returns:
        The per-worker ``BENCH_RESULT`` payloads.
    """
    worker_argv = [sys.executable, "-m", "bpstrain.bench._bps_worker", *_case_args(cases)]
    extra = dict(extra_env or {})
    if partition_bytes:
        worker_argv += ["--partition-bytes", str(partition_bytes)]
        extra["BYTEPS_PARTITION_BYTES"] = str(partition_bytes)
    return run_ps_job(hosts, layout, worker_argv, timeout_s, extra)


def run_ps_job(hosts: Hosts, layout: Layout, worker_argv: Sequence[str], timeout_s: float,
               extra_env: dict[str, str] | None = None) -> list[dict]:
    """Starts a scheduler, servers (``python -m bpstrain.launch``) and ``worker_argv`` workers.

    Every process gets BytePS's ``DMLC_*`` variables for ``layout``, plus
    ``extra_env``. Workers must print a ``BENCH_RESULT`` line.

    Returns:
        The per-worker ``BENCH_RESULT`` payloads, in worker order.
    """
    local = layout.local_size
    common = {
        "DMLC_NUM_WORKER": str(len(layout.worker_hosts)),  # hosts, as in BytePS
        "DMLC_NUM_SERVER": str(layout.num_servers),
        "DMLC_PS_ROOT_URI": hosts.addr(layout.scheduler_host),
        "DMLC_PS_ROOT_PORT": str(hosts.next_port()),
        "DMLC_INTERFACE": hosts.ifname,
        # Below the job deadline, so a stuck peer surfaces as the engine's own
        # error message rather than as a bare "did not finish".
        "BPSTRAIN_TIMEOUT": str(max(10, int(0.75 * timeout_s))),
        # Roles SIGTERM themselves if this process dies (see bpstrain.launch).
        "BPSTRAIN_LAUNCH_PARENT": str(os.getpid()),
        **(extra_env or {}),
    }
    role_argv = [sys.executable, "-m", "bpstrain.launch"]
    job = Job(hosts)
    job.start("scheduler", layout.scheduler_host, role_argv, child_env({
        **common, "DMLC_ROLE": "scheduler",
        "DMLC_NODE_HOST": hosts.addr(layout.scheduler_host)}))
    server_hosts = [*layout.server_hosts, *(layout.worker_hosts if layout.colocated else ())]
    for j, host in enumerate(server_hosts):
        job.start(f"server{j}", host, role_argv, child_env({
            **common, "DMLC_ROLE": "server", "DMLC_NODE_HOST": hosts.addr(host)}))
    for i, host in enumerate(layout.worker_hosts):
        for j in range(local):
            job.start(f"worker{i * local + j}", host, list(worker_argv), child_env({
                **common, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(i),
                "BYTEPS_LOCAL_RANK": str(j), "BYTEPS_LOCAL_SIZE": str(local),
                "DMLC_NODE_HOST": hosts.addr(host)}), worker=True)
    return job.collect(timeout_s)


def _case_args(cases: Sequence[_report.Case]) -> list[str]:
    return [arg for case in cases for arg in ("--case", _report.format_case(case))]


class Job:
    """The processes of one job, their output files and their exit codes."""

    def __init__(self, hosts: Hosts) -> None:
        self._hosts = hosts
        self._procs: dict[str, Watched] = {}
        self._files: dict[str, tuple] = {}
        self._workers: list[str] = []
        self._exits: queue.Queue = queue.Queue()
        # Children run in their own sessions, so SIGTERM/exit of this process
        # would not reach them: let the teardown hooks kill them.
        _teardown.register(self)

    def start(self, name: str, host: int, argv: list[str], env: dict[str, str],
              worker: bool = False) -> None:
        """Starts ``argv`` on ``host``; ``worker=True`` marks it as a result reporter."""
        # Files, not pipes: a chatty child can never block on a full pipe.
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self._files[name] = (out, err)
        try:
            proc = self._hosts.popen(host, argv, env=env, stdout=out, stderr=err,
                                     stdin=subprocess.DEVNULL)
        except BaseException:
            self.kill()
            raise
        if worker:
            self._workers.append(name)
        # Hosts start every process in its own session: its group is what teardown stops.
        self._procs[name] = Watched(name, proc,
                                    lambda w: self._exits.put((w.label, w.proc.returncode)))

    def collect(self, timeout_s: float) -> list[dict]:
        """Waits for every process; returns the workers' payloads in start order."""
        try:
            self._wait_all(timeout_s)
            return [_report.parse_result(self._read(name, 0)) for name in self._workers]
        except BaseException:
            self.kill()
            raise
        finally:
            _teardown.unregister(self)
            for out, err in self._files.values():
                out.close()
                err.close()

    def _wait_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending_workers = set(self._workers)
        remaining = len(self._procs)
        while remaining:
            # Roles get a grace period once the workers are done, not the full budget.
            try:
                name, rc = self._exits.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                late = sorted(n for n, p in self._procs.items() if p.running())
                self._dump_stacks(late)
                raise BenchError(f"Benchmark job did not finish within {timeout_s:.0f} s. "
                                 f"Received: still running {late}{self._tails(late)}")
            remaining -= 1
            pending_workers.discard(name)
            if rc != 0:
                raise BenchError(f"Benchmark process {name} failed. "
                                 f"Received: exit code {rc}{self._tails([name])}")
            if not pending_workers:
                deadline = min(deadline, time.monotonic() + _ROLE_GRACE_S)

    def _dump_stacks(self, names: Sequence[str]) -> None:
        # Our workers dump their Python stacks on SIGUSR1 (faulthandler); for
        # any other process the default action ends it, which kill() would anyway.
        for name in names:
            if name in self._workers:
                self._procs[name].proc.send_signal(signal.SIGUSR1)
        for name in names:
            self._procs[name].wait(1.0)  # time to write the dump

    def kill(self) -> None:
        """Stops every still-running process of the job and its group (SIGTERM, SIGKILL)."""
        stop_children(list(self._procs.values()), _KILL_GRACE_S)

    close = kill  # the name _teardown calls

    def _read(self, name: str, stream: int) -> str:
        handle = self._files[name][stream]
        handle.flush()
        handle.seek(0)
        return handle.read()

    def _tails(self, names: Sequence[str]) -> str:
        parts = []
        for name in names:
            tail = self._read(name, 1).strip().splitlines()[-25:]
            parts.append(f"\n--- {name} stderr (last lines) ---\n" + "\n".join(tail))
        return "".join(parts)


_Job = Job  # earlier name, still used by sibling benchmark modules
