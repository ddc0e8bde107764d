"""Attacks a live job on loopback and checks that nothing gave way::

    python -m bpstrain.bench fuzz                      # the full run (about a minute)
    python -m bpstrain.bench fuzz --floods 2000 --frames 300   # the short run CI does
    python -m bpstrain.bench fuzz --rounds 50000 --floods 0    # the soak: flat RSS

A real job (a scheduler, a server and two workers, separate processes, with a cluster
secret as the launcher gives every local job) sums a 4 KiB tensor round after round,
and every worker checks every sum exactly. Before the workers join, the fuzzer tries to
register as the job's server with a wrong secret and with none, and replays a
handshake it captured. While they run it sends malformed frames, floods both listening
ports with connect/close cycles, drips handshakes one byte at a time, and pushes into
the server without a credential, with a forged one, and with none at all. Then it
checks: every attack was refused, the scheduler and the server never died, their
threads and file descriptors came back to the baseline taken after rendezvous, their
RSS stayed within ``--rss-bound-mb`` of it, every worker's sums were right, and every
process exited 0. Only loopback and this job's own ports are touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import random
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from bpstrain.bench import _protocol as wire
from bpstrain.bench.table import render


@dataclasses.dataclass
class FuzzPlan:
    """What the fuzzer does."""

    rounds: int = 2000       # rounds every worker runs at least (the soak sets 50,000)
    frames: int = 10000      # malformed frames, each on a connection of its own
    floods: int = 50000      # connect/close cycles, split over the two listeners
    drips: int = 4           # handshakes dripped one byte every half second
    injections: int = 200    # push attempts into the server without a valid credential
    rss_bound_mb: float = 64.0
    timeout_s: float = 900.0
    seed: int = 1


@dataclasses.dataclass
class FuzzReport:
    """What happened; ``ok`` is False with ``problems`` saying why."""

    counts: dict
    baseline: dict
    after: dict
    rss_growth_mb: dict
    rounds: list
    exit_codes: dict
    problems: list

    @property
    def ok(self) -> bool:
        return not self.problems


def _proc_status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Threads", "VmRSS"):
                out[key] = int(value.split()[0])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def _listening_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on (its socket inodes in /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    with open(f"/proc/{pid}/net/tcp", encoding="ascii") as f:
        next(f)
        for line in f:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                ports.append(int(cols[1].split(":")[1], 16))
    return ports


def _garbage(rng: random.Random) -> bytes:
    """One malformed or unexpected frame (or plain noise)."""
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 200))
    if kind == 1:  # a header with random fields
        return wire.HEADER.pack(wire.MAGIC, rng.randrange(65536), rng.randrange(65536), rng.randrange(1 << 32),
                                rng.randrange(-1 << 31, 1 << 31), rng.randrange(-1 << 63, 1 << 63),
                                rng.randrange(1 << 64), rng.randrange(1 << 64), rng.randrange(1 << 64))
    if kind == 2:  # a big metadata length before anyone authenticated
        return wire.header(wire.AUTH_HELLO, meta_len=rng.choice([513, 1 << 20, (1 << 32) - 1]))
    if kind == 3:  # any frame type before the handshake
        return wire.frame(rng.randrange(1, 25), rng.randbytes(rng.randrange(0, 64)))
    if kind == 4:  # a truncated hello
        return wire.frame(wire.AUTH_HELLO, wire.s(os.urandom(32)))[:rng.randrange(1, 60)]
    if kind == 5:  # a hello with a bad nonce or an oversized identity
        return wire.frame(wire.AUTH_HELLO, wire.s(os.urandom(rng.randrange(0, 31))) + wire.s("x" * 300)
                          + struct.pack("<I", 1))
    return wire.frame(wire.PUSH, b"", rng.randbytes(64), arg=64, flags=2 << 8, sender=0)


class _Fuzzer:
    def __init__(self, plan: FuzzPlan):
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.counts = {"frames": 0, "connections": 0, "drips cut": 0, "replays refused": 0,
                       "impostors refused": 0, "injections refused": 0}
        self.problems: list[str] = []

    def expect_refused(self, what: str, fn) -> None:
        """fn() must end in a refusal: an error frame, or the connection closed on it.
        Not reaching the port at all is a problem of its own, not a refusal."""
        try:
            fn()
        except ConnectionRefusedError:
            self.problems.append(f"{what}: the port did not accept the connection")
            return
        except (wire.Refused, ConnectionResetError, BrokenPipeError):
            return
        except (TimeoutError, socket.timeout):
            self.problems.append(f"{what}: the peer neither answered nor closed (hung)")
            return
        except AssertionError:
            pass
        self.problems.append(f"{what} was not refused")

    def impersonate(self, port: int, secret: str) -> None:
        for key in (wire.cluster_key("not the secret"), b""):
            def attempt(key=key):
                c = wire.Conn(port)
                try:
                    wire.handshake(c, key, "server", check_acceptor=False)
                    c.send(wire.HELLO, wire.worker_hello(0, role=1), sender=-1)
                    if c.recv() is not None:  # registered as a server: the welcome would follow
                        raise AssertionError
                finally:
                    c.close()
            self.expect_refused("registering as the server with a wrong or missing secret", attempt)
            self.counts["impostors refused"] += 1

    def replay(self, port: int, secret: str) -> None:
        # Capture a real handshake (the fuzzer knows this job's secret), then replay
        # what the connecting side sent on a new connection.
        # Right after the flood the listener may still be at its pending-handshake limit
        # (the flood's connection threads reap themselves as they get scheduled): a refusal
        # of this honest handshake is the limiter working, not a finding; try again shortly.
        for tries_left in reversed(range(40)):
            c = wire.Conn(port)
            try:
                wire.handshake(c, wire.cluster_key(secret), "worker")
                break
            except wire.Refused:
                c.close()
                if not tries_left:
                    raise
                time.sleep(0.25)
        captured = list(c.sent)
        c.close()

        def attempt():
            r = wire.Conn(port)
            try:
                r.send_raw(captured[0])  # the hello
                r.recv()                 # a fresh challenge
                r.send_raw(captured[1])  # the old proof
                reply = r.recv()
                if reply is not None and reply[0] == wire.AUTH_OK:
                    raise AssertionError
                raise wire.Refused("refused")
            finally:
                r.close()
        self.expect_refused("a replayed handshake", attempt)
        self.counts["replays refused"] += 1

    def malformed(self, ports: list[int]) -> None:
        for i in range(self.plan.frames):
            try:
                with socket.create_connection(("127.0.0.1", ports[i % len(ports)]), timeout=5) as sock:
                    sock.sendall(_garbage(self.rng))
            except OSError:
                pass
            self.counts["frames"] += 1

    def flood(self, ports: list[int]) -> None:
        for i in range(self.plan.floods):
            try:
                socket.create_connection(("127.0.0.1", ports[i % len(ports)]), timeout=5).close()
            except OSError:
                time.sleep(0.01)
            self.counts["connections"] += 1

    def drip(self, ports: list[int]) -> None:
        def one(port: int) -> None:
            start = time.monotonic()
            hello = wire.frame(wire.AUTH_HELLO, wire.s(os.urandom(32)) + wire.s("worker") + struct.pack("<I", 1))
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                try:
                    for byte in hello * 10:
                        sock.send(bytes([byte]))
                        time.sleep(0.5)
                        if time.monotonic() - start > 20:
                            self.problems.append("a dripped handshake was still open after 20 s")
                            return
                except OSError:
                    self.counts["drips cut"] += 1
                    return
        threads = [threading.Thread(target=one, args=(ports[i % len(ports)],)) for i in range(self.plan.drips)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def inject(self, server_port: int) -> None:
        for i in range(self.plan.injections):
            key = [b"", os.urandom(32)][i % 2]

            def attempt(key=key):
                c = wire.Conn(server_port)
                try:
                    if key:
                        wire.handshake(c, key, "worker 0", check_acceptor=False)
                    for v in range(4):
                        c.send(wire.PUSH, b"", struct.pack("<256f", *([1e6] * 256)), arg=1024, flags=2 << 8,
                               sender=0, key=0, version=v)
                    if c.recv() is not None:
                        raise AssertionError
                    raise wire.Refused("closed")
                finally:
                    c.close()
            self.expect_refused("a push without a valid credential", attempt)
            self.counts["injections refused"] += 1


def run(plan: FuzzPlan) -> FuzzReport:
    """Runs the job and the attacks; returns what was seen (``report.ok`` says if it held)."""
    from bpstrain.launch.local import LocalServices

    secret = secrets.token_hex(32)
    fz = _Fuzzer(plan)
    stop_file = os.path.join(tempfile.mkdtemp(prefix="bpstrain-fuzz-"), "stop")
    log = io.StringIO()
    services = LocalServices(2, 1, env={"BPSTRAIN_SECRET": secret, "BPSTRAIN_HIERARCHICAL": "false"},
                             output=log)
    workers: list[subprocess.Popen] = []
    rss_peak: dict = {}
    try:
        services.start()
        pids = {("scheduler" if "sched" in c.label else "server"): c.proc.pid for c in services.children}
        sched_port = services.port
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (_listening_ports(pids["server"])
                                                   and sched_port in _listening_ports(pids["scheduler"])):
            time.sleep(0.05)
        server_port = _listening_ports(pids["server"])[0]
        # Before rendezvous: a stranger tries to take the server's place.
        fz.impersonate(sched_port, secret)
        fz.replay(sched_port, secret)
        ready = stop_file + "-ready"
        cmd = [sys.executable, "-m", "bpstrain.bench._fuzz_worker", "--rounds", str(plan.rounds),
               "--until", stop_file, "--ready", ready]
        workers = [subprocess.Popen(cmd, env=services.worker_env(i), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for i in range(2)]
        # The baseline is the running job: both workers are past rendezvous and a round.
        deadline = time.monotonic() + 120
        while not all(os.path.exists(f"{ready}.{i}") for i in range(2)):
            if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                raise RuntimeError("the fuzzer's job did not start: " + log.getvalue()[-2000:])
            time.sleep(0.05)
        time.sleep(0.5)
        baseline = {name: _proc_status(pid) for name, pid in pids.items()}
        # RSS is watched on every process of the job, the workers too (the soak).
        rss_pids = {**pids, **{f"worker {i}": w.pid for i, w in enumerate(workers)}}
        rss_base = {name: _proc_status(pid)["VmRSS"] for name, pid in rss_pids.items()}
        rss_peak = dict(rss_base)
        sampling = threading.Event()

        def sample():
            while not sampling.wait(0.2):
                for name, pid in rss_pids.items():
                    try:
                        rss_peak[name] = max(rss_peak[name], _proc_status(pid)["VmRSS"])
                    except OSError:
                        pass
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        ports = [sched_port, server_port]
        fz.malformed(ports)
        fz.flood(ports)
        fz.inject(server_port)
        fz.replay(sched_port, secret)
        fz.drip(ports)
        for name, child in zip(pids, services.children):
            if child.returncode is not None:
                fz.problems.append(f"the {name} exited during the attacks (code {child.returncode})")
        # Connection threads are joined as the next connection arrives or at exit; give
        # the handshakes in flight their deadline, then one more connection reaps them.
        after = {}
        settle = time.monotonic() + 15
        while True:
            for p in ports:
                try:
                    socket.create_connection(("127.0.0.1", p), timeout=5).close()
                except OSError:
                    pass
            time.sleep(0.5)
            after = {name: _proc_status(pid) for name, pid in pids.items()}
            back = all(after[n]["Threads"] <= baseline[n]["Threads"] + 2 and after[n]["fds"] <= baseline[n]["fds"] + 2
                       for n in pids)
            if back or time.monotonic() > settle:
                break
        for n in pids:
            if after[n]["Threads"] > baseline[n]["Threads"] + 2:
                fz.problems.append(f"{n} threads {baseline[n]['Threads']} -> {after[n]['Threads']}")
            if after[n]["fds"] > baseline[n]["fds"] + 2:
                fz.problems.append(f"{n} file descriptors {baseline[n]['fds']} -> {after[n]['fds']}")
        sampling.set()
        growth = {n: (rss_peak[n] - rss_base[n]) / 1024 for n in rss_pids}
        for n, mb in growth.items():
            if mb > plan.rss_bound_mb:
                fz.problems.append(f"{n} RSS grew by {mb:.1f} MB (bound {plan.rss_bound_mb:g})")
        open(stop_file, "w").close()
        rounds, codes = [], {}
        for i, w in enumerate(workers):
            out, _ = w.communicate(timeout=plan.timeout_s)
            codes[f"worker {i}"] = w.returncode
            rounds.append(out.strip().splitlines()[-1] if out.strip() else "")
            if w.returncode != 0:
                fz.problems.append(f"worker {i} exited {w.returncode}: {out.strip()[-300:]}")
        services.wait(60)
        for name, child in zip(pids, services.children):
            codes[name] = child.returncode
            if child.returncode != 0:
                fz.problems.append(f"the {name} exited {child.returncode}")
        return FuzzReport(fz.counts, baseline, after, growth, rounds, codes, fz.problems)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        services.stop()
        for path in (stop_file, stop_file + "-ready.0", stop_file + "-ready.1"):
            try:
                os.unlink(path)
            except OSError:
                pass
        os.rmdir(os.path.dirname(stop_file))


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = FuzzPlan()
    p.add_argument("--rounds", type=int, default=d.rounds, help="rounds every worker runs at least")
    p.add_argument("--frames", type=int, default=d.frames, help="malformed frames")
    p.add_argument("--floods", type=int, default=d.floods, help="connect/close cycles")
    p.add_argument("--drips", type=int, default=d.drips, help="slow handshakes")
    p.add_argument("--injections", type=int, default=d.injections, help="forged pushes")
    p.add_argument("--rss-bound-mb", type=float, default=d.rss_bound_mb)
    p.add_argument("--seed", type=int, default=d.seed)


def run_args(args: argparse.Namespace):
    report = run(FuzzPlan(rounds=args.rounds, frames=args.frames, floods=args.floods, drips=args.drips,
                          injections=args.injections, rss_bound_mb=args.rss_bound_mb, seed=args.seed))
    rows = [[k, str(v)] for k, v in report.counts.items()]
    for n in report.baseline:
        b, a = report.baseline[n], report.after[n]
        rows.append([f"{n} threads (baseline -> after)", f"{b['Threads']} -> {a['Threads']}"])
        rows.append([f"{n} fds (baseline -> after)", f"{b['fds']} -> {a['fds']}"])

    rows += [[f"{n} peak RSS growth", f"{mb:.1f} MB"] for n, mb in report.rss_growth_mb.items()]
    rows += [[f"worker {i}", r] for i, r in enumerate(report.rounds)]
    rows.append(["exit codes", ", ".join(f"{k} {v}" for k, v in report.exit_codes.items())])
    rows.append(["verdict", "held" if report.ok else "FAILED: " + "; ".join(report.problems)])
    title = "fuzz: attacks on a live job on loopback (scheduler, server, 2 workers)"
    return title, render(["", "value"], rows), [dataclasses.asdict(report)]
