"""The control plane at scale: a real scheduler against many simulated nodes::

    python -m bpstrain.bench control-plane                       # n = 16 64 256 1024
    python -m bpstrain.bench control-plane --workers 64 --servers 4 --barriers 50
    python -m bpstrain.bench control-plane --transport tcp       # scheduler in its own process

What a large job meets before its first gradient: registration (the secure handshake
and the hello of every node), the address book (the welcome: server endpoints and one
data credential per peer), barriers, heartbeats and shutdown. The scheduler is the real
engine's (``bpstrain._core.Scheduler``); each worker and server is a *simulated node*:
one frame link (``_core.connect_raw``) driven from this process that speaks the control
protocol exactly as ``core_ext/src/control.cc`` does, and opens no data connections.
So 1,024 workers cost the scheduler what 1,024 real ones would (a connection, its
reader thread and its outbox), and cost this machine no more than that.

Columns: ``form`` from the first connection until every node holds its welcome;
``book`` the bytes of one worker's welcome; ``barrier`` the median (``max`` the
slowest) over ``--barriers`` barriers, from the first worker's kBarrier until the last
worker read its reply; ``hb+barrier`` one heartbeat from every node followed by a
barrier (so every worker's heartbeat was processed); ``shutdown`` from the first
goodbye until every server got kTerminate and the scheduler stopped (its threads
joined); ``sched mem`` the scheduler's memory, see below; ``threads`` the OS threads
the scheduler added by the time the job formed (a reader and an outbox writer per node,
its accept and monitor threads). Times include this process's own work for the
simulated nodes (Python, one thread), so they are upper bounds of the scheduler's.

Memory: with ``--transport inproc`` (default) the scheduler runs in this process, and
``sched mem`` is the growth of this process's RSS from before the scheduler was made
until the job formed: the scheduler plus the simulated nodes' ends of their links (small
queues, no threads). With ``--transport tcp`` the scheduler runs alone in a child
process and ``sched mem`` is that process's RSS growth from before the scheduler was
made: the scheduler's own, nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from bpstrain import _core
from bpstrain.bench._jobs import BenchError
from bpstrain.bench.table import format_time, render

HELLO, WELCOME, BARRIER, BARRIER_REPLY, HEARTBEAT, GOODBYE, TERMINATE = 1, 2, 5, 6, 7, 8, 9
SERVER, WORKER = 1, 2
_ROLE_NAME = {SERVER: "server", WORKER: "worker"}
_CONNECTORS = 8  # threads that open the simulated nodes' links, as nodes start at once


@dataclasses.dataclass
class Case:
    """One measured job: n simulated workers and k simulated servers."""

    workers: int
    servers: int
    transport: str
    form_s: float
    welcome_bytes: int
    barrier_s: float
    barrier_max_s: float
    heartbeat_barrier_s: float
    shutdown_s: float
    memory_bytes: int
    threads: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _str(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<I", len(raw)) + raw


def hello(role: int, rank: int, endpoint: str = "") -> bytes:
    """kHello as ControlClient::Hello writes it: role, rank hint, listen endpoint,
    advertise host, pid, hostname, local size, host id."""
    return (struct.pack("<Iq", role, rank) + _str(endpoint) + _str("") + struct.pack("<q", os.getpid())
            + _str("sim") + struct.pack("<I", 1) + _str(""))


class SimNode:
    """One simulated worker or server: its control link to the scheduler."""

    def __init__(self, role: int, rank: int):
        self.role, self.rank, self.link = role, rank, None

    def connect(self, transport: str, port: int, secret: str, deadline: float) -> None:
        """Handshake and hello; retries while the scheduler refuses at the door (more
        strangers in their handshake than it admits at once), as ControlClient does."""
        endpoint = "inproc:1" if transport == "inproc" else "127.0.0.1:9"
        while True:
            try:
                self.link = _core.connect_raw(transport, "127.0.0.1", port, timeout=10.0, handshake=True,
                                              secret=secret, identity=_ROLE_NAME[self.role])
                break
            except Exception:  # noqa: BLE001 - refused at the door: retry until the deadline
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self.link.send(HELLO, hello(self.role, self.rank, endpoint if self.role == SERVER else ""))

    def send(self, type_: int) -> None:
        self.link.send(type_, sender=self.rank)

    def expect(self, type_: int, timeout: float) -> bytes:
        frame = self.link.recv(timeout)
        if frame is None or frame[0] != type_:
            got = "the link closed" if frame is None else f"frame type {frame[0]} {frame[4][:200]!r}"
            raise BenchError(f"{_ROLE_NAME[self.role]} {self.rank} expected frame type {type_}; got {got}")
        return frame[4]


def _rss(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _threads(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


_CHILD = """
import os, sys, time
from bpstrain import _core
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
base, threads = rss(), len(os.listdir('/proc/self/task'))
s = _core.Scheduler({workers}, {servers}, host='127.0.0.1', port=0, rendezvous_timeout={timeout},
                    peer_timeout={timeout}, secret={secret!r}, transport='tcp')
s.start()
print(s.port, base, threads, flush=True)
while not s.wait(0.01):
    pass
s.stop()
print('stopped', flush=True)
"""


class _LocalScheduler:
    """The scheduler in this process (any transport)."""

    def __init__(self, workers, servers, transport, secret, timeout):
        self.base, self.base_threads = _rss(), _threads()
        self.sched = _core.Scheduler(workers, servers, host="127.0.0.1", port=0, rendezvous_timeout=timeout,
                                     peer_timeout=timeout, secret=secret, transport=transport)
        self.sched.start()
        self.port = self.sched.port

    def memory(self) -> int:
        return _rss() - self.base

    def threads(self) -> int:
        return _threads() - self.base_threads

    def finish(self, timeout: float) -> None:
        if not self.sched.wait(timeout):
            raise BenchError("the scheduler did not finish after every worker's goodbye")
        self.sched.stop()

    def close(self) -> None:
        self.sched.stop()


class _ChildScheduler:
    """The scheduler alone in a child process over TCP: its RSS is the scheduler's."""

    def __init__(self, workers, servers, transport, secret, timeout):
        code = _CHILD.format(workers=workers, servers=servers, timeout=timeout, secret=secret)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        if len(line) != 3:
            self.proc.kill()
            raise BenchError("the scheduler process did not start")
        self.port, self.base, self.base_threads = (int(x) for x in line)

    def memory(self) -> int:
        return _rss(self.proc.pid) - self.base

    def threads(self) -> int:
        return _threads(self.proc.pid) - self.base_threads

    def finish(self, timeout: float) -> None:
        if self.proc.stdout.readline().strip() != "stopped":
            raise BenchError("the scheduler process did not stop cleanly")
        self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))


def _barrier(workers: list[SimNode], timeout: float) -> float:
    start = time.perf_counter()
    for w in workers:
        w.send(BARRIER)
    for w in workers:
        w.expect(BARRIER_REPLY, timeout)
    return time.perf_counter() - start


def run_case(workers: int, servers: int, transport: str = "inproc", barriers: int = 20,
             secret: str = "", timeout: float = 120.0) -> Case:
    """Forms one job of simulated nodes, times its barriers and shutdown; raises
    BenchError when any step fails (a node not welcomed, a barrier not released)."""
    if workers < 1 or servers < 1 or barriers < 1:
        raise ValueError(f"Expected workers, servers and barriers >= 1. Received: {workers}, {servers}, {barriers}")
    if transport not in ("inproc", "tcp") and not transport.startswith("ucx"):
        raise ValueError(f"Expected transport 'inproc', 'tcp' or 'ucx[:<tls>]'. Received: {transport!r}")
    _raise_fd_limit(2 * (workers + servers) + 256)
    host = (_LocalScheduler if transport == "inproc" else _ChildScheduler)(workers, servers, transport,
                                                                          secret, timeout)
    nodes = [SimNode(SERVER, j) for j in range(servers)] + [SimNode(WORKER, i) for i in range(workers)]
    sims = nodes[servers:]
    try:
        deadline = time.monotonic() + timeout
        start = time.perf_counter()
        with ThreadPoolExecutor(_CONNECTORS) as pool:
            for f in [pool.submit(n.connect, transport, host.port, secret, deadline) for n in nodes]:
                f.result()
        book = [n.expect(WELCOME, timeout) for n in nodes]
        form_s = time.perf_counter() - start
        for n, meta in zip(nodes, book):
            if struct.unpack_from("<q", meta)[0] != n.rank:
                raise BenchError(f"{_ROLE_NAME[n.role]} {n.rank} was welcomed with another rank")
        memory, threads = host.memory(), host.threads()
        times = [_barrier(sims, timeout) for _ in range(barriers)]
        start = time.perf_counter()
        for n in nodes:
            n.send(HEARTBEAT)
        _barrier(sims, timeout)
        heartbeat_s = time.perf_counter() - start
        start = time.perf_counter()
        for w in sims:
            w.send(GOODBYE)
        for s in nodes[:servers]:
            s.expect(TERMINATE, timeout)
        host.finish(timeout)
        shutdown_s = time.perf_counter() - start
    finally:
        for n in nodes:
            if n.link is not None:
                n.link.shutdown()
        host.close()
    return Case(workers, servers, transport, form_s, len(book[-1]), statistics.median(times), max(times),
                heartbeat_s, shutdown_s, memory, threads)


def default_servers(workers: int) -> int:
    """One server per 16 workers, at least 4 and at most 64 (16 -> 4, 1024 -> 64)."""
    return min(64, max(4, workers // 16))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 64, 256, 1024],
                        help="simulated workers per job (16 64 256 1024)")
    parser.add_argument("--servers", type=int, nargs="+", default=None,
                        help="simulated servers: one value for every job or one per --workers "
                        "value (default workers/16, between 4 and 64)")
    parser.add_argument("--transport", choices=["inproc", "tcp"], default="inproc",
                        help="inproc: scheduler in this process; tcp: alone in a child process")
    parser.add_argument("--barriers", type=int, default=20, help="barriers timed per job")
    parser.add_argument("--secret", default="", help="cluster secret (authenticated control plane)")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def run_args(args: argparse.Namespace) -> tuple[str, str, list[dict]]:
    servers = args.servers or [default_servers(n) for n in args.workers]
    if len(servers) == 1:
        servers = servers * len(args.workers)
    if len(servers) != len(args.workers):
        raise ValueError(f"Expected one --servers value or one per --workers value. Received: {servers}")
    cases = []
    for n, k in zip(args.workers, servers):
        print(f"control-plane: {n} workers, {k} servers over {args.transport} ...", file=sys.stderr)
        cases.append(run_case(n, k, args.transport, args.barriers, args.secret))
    lines = [(str(c.workers), str(c.servers), format_time(c.form_s), f"{c.welcome_bytes} B",
              format_time(c.barrier_s), format_time(c.barrier_max_s), format_time(c.heartbeat_barrier_s),
              format_time(c.shutdown_s), _mib(c.memory_bytes), str(c.threads)) for c in cases]
    text = render(("n", "k", "form", "book", "barrier", "max", "hb+barrier", "shutdown", "sched mem",
                   "threads"), lines)
    where = "this process" if args.transport == "inproc" else "its own process"
    title = (f"control plane, simulated nodes over {args.transport}, scheduler in {where} "
             f"({os.cpu_count()} cores; {args.barriers} barriers per job)")
    return title, text, [c.as_dict() for c in cases]
