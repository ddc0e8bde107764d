"""An emulated multi-host cluster on one machine: network namespaces + tbf.

Topology for ``EmulatedCluster(hosts=H, rate_mbit=R)``::

    host ns <prefix>-h0  eth0 (10.213.0.1/24) ==veth== p0 ┐
    host ns <prefix>-h1  eth0 (10.213.0.2/24) ==veth== p1 ├ br0  in ns <prefix>-sw
    ...                                                   ┘

The bridge lives in its own "switch" namespace, so nothing is attached to the
root namespace: no address, route or interface is added there and traffic can
only flow between the emulated hosts. Each host's link is shaped with a token
bucket (``tc qdisc tbf``; netem is not available): the egress of the host-side
veth caps its upload, the egress of the switch-side veth caps its download.

Example:
    >>> with EmulatedCluster(hosts=2, rate_mbit=800) as cluster:  # doctest: +SKIP
    ...     server = cluster.popen(1, ["python", "-m", "http.server", "8000"])
    ...     client = cluster.popen(0, ["curl", f"http://{cluster.addr(1)}:8000/"])
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence

from bpstrain.bench import _teardown

DEFAULT_PREFIX = "bpsb"
HOST_IFNAME = "eth0"
_BRIDGE = "br0"
_counter = itertools.count()


def available() -> tuple[bool, str]:
    """Tells whether emulated clusters can be built here.

    Returns:
        ``(True, "")`` when running as root with ``ip`` and ``tc`` on PATH,
        otherwise ``(False, reason)`` suitable for ``pytest.skip(reason)``.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "emulated cluster needs root (network namespaces, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"emulated cluster needs the '{tool}' command (iproute2)"
    return True, ""


def list_namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Names of the network namespaces whose name starts with ``prefix``."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         check=False).stdout
    names = (line.split()[0] for line in out.splitlines() if line.strip())
    return sorted(n for n in names if n.startswith(prefix))


def cleanup_stale(prefix: str = DEFAULT_PREFIX, only_dead_owners: bool = True) -> list[str]:
    """Deletes namespaces left behind by emulated clusters that were not closed.

    Args:
        prefix: Namespace name prefix; instances are named ``<prefix><pid>x<n>-...``.
        only_dead_owners: Delete only namespaces whose creating process (the pid
            in the name) has exited, so a concurrent run is not disturbed.

    Returns:
        The deleted namespace names.
    """
    deleted = []
    for name in list_namespaces(prefix):
        owner = _owner_pid(name, prefix)
        # A name we cannot attribute to a dead owner is not ours to delete.
        if only_dead_owners and (owner is None or _pid_alive(owner)):
            continue
        _kill_namespace_pids(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        deleted.append(name)
    return deleted


class EmulatedCluster:
    """H emulated hosts with rate-capped links, usable as a context manager.

    Args:
        hosts: Number of hosts (1-250).
        rate_mbit: Link rate in Mbit/s, one for all hosts or one per host.
            Upload and download are each capped at this rate.
        subnet: First three octets of the private /24 used inside the namespaces.
        latency_ms: tbf queue length expressed as the longest time a packet may wait.
        prefix: Namespace name prefix (the pid and a counter are appended).

    Raises:
        RuntimeError: When not available (see ``available()``) or a command fails;
            everything created so far is removed before raising.
    """

    def __init__(self, hosts: int, rate_mbit: float | Sequence[float], *,
                 subnet: str = "10.213.0", latency_ms: float = 20.0,
                 prefix: str = DEFAULT_PREFIX) -> None:
        ok, reason = available()
        if not ok:
            raise RuntimeError(f"Cannot build an emulated cluster: {reason}.")
        if not 1 <= hosts <= 250:
            raise ValueError(f"Expected 1 <= hosts <= 250. Received: hosts={hosts}")
        rates = [float(rate_mbit)] * hosts if isinstance(rate_mbit, (int, float)) \
            else [float(r) for r in rate_mbit]
        if len(rates) != hosts or min(rates) <= 0:
            raise ValueError("Expected one positive rate or one per host. "
                             f"Received: rate_mbit={rate_mbit!r}, hosts={hosts}")
        _check_subnet(subnet)
        self.rates_mbit = rates
        self.ifname = HOST_IFNAME
        self.name = f"{prefix}{os.getpid()}x{next(_counter)}"
        self._switch = f"{self.name}-sw"
        self._hosts = [f"{self.name}-h{i}" for i in range(hosts)]
        self._addrs = [f"{subnet}.{i + 1}" for i in range(hosts)]
        self._latency_ms = latency_ms
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._closed = False
        self._closing = False
        _teardown.register(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @property
    def num_hosts(self) -> int:
        """Number of emulated hosts."""
        return len(self._hosts)

    def addr(self, i: int) -> str:
        """IPv4 address of host ``i`` (reachable from every other host)."""
        return self._addrs[i]

    def netns(self, i: int) -> str:
        """Network namespace name of host ``i``."""
        return self._hosts[i]

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Starts ``argv`` inside host ``i``; it is killed at ``close()`` if still running.

        Args:
            i: Host index.
            argv: Command line.
            env: Full environment of the child (default: this process's environment).
            **kwargs: Passed on to ``subprocess.Popen`` (stdout, stderr, cwd, ...).
        """
        if self._closed:
            raise RuntimeError(f"EmulatedCluster {self.name} is closed. Received: popen({i})")
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self._hosts[i], *argv],
                                env=dict(env) if env is not None else None, **kwargs)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Kills processes started here and deletes every namespace. Idempotent.

        If interrupted half-way (e.g. a second Ctrl-C), the cluster stays
        registered and the ``atexit`` hook finishes the job.
        """
        self._closed = True
        if self._closing:  # re-entered from a signal handler while closing
            return
        self._closing = True
        try:
            while self._procs:
                _terminate(self._procs.pop())
            while self._created:
                ns = self._created[-1]
                _kill_namespace_pids(ns)
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
                self._created.pop()
        finally:
            self._closing = False
        _teardown.unregister(self)

    def __enter__(self) -> "EmulatedCluster":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _build(self) -> None:
        sw = self._switch
        self._add_namespace(sw)
        _ip("-n", sw, "link", "add", _BRIDGE, "type", "bridge")
        _ip("-n", sw, "link", "set", _BRIDGE, "up")
        for i, ns in enumerate(self._hosts):
            port = f"p{i}"
            self._add_namespace(ns)
            # Created directly inside the namespaces: never visible in the root one.
            _ip("link", "add", HOST_IFNAME, "netns", ns, "type", "veth",
                "peer", "name", port, "netns", sw)
            _ip("-n", sw, "link", "set", port, "master", _BRIDGE)
            _ip("-n", sw, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self._addrs[i]}/24", "dev", HOST_IFNAME)
            _ip("-n", ns, "link", "set", HOST_IFNAME, "up")
            self._shape(ns, HOST_IFNAME, self.rates_mbit[i])   # upload
            self._shape(sw, port, self.rates_mbit[i])          # download

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str, rate_mbit: float) -> None:
        rate_bytes = rate_mbit * 1e6 / 8
        # The bucket must hold at least one GSO super-packet (64 KiB) and a few
        # timer ticks of traffic, or tbf cannot reach the configured rate.
        burst = int(max(rate_bytes * 0.002, 96 * 1024))
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
              "rate", f"{rate_mbit}mbit", "burst", str(burst),
              "latency", f"{self._latency_ms}ms"])


def _check_subnet(subnet: str) -> None:
    try:
        net = ipaddress.ip_network(f"{subnet}.0/24")
    except ValueError:
        net = None
    if net is None or net.version != 4 or not net.is_private:
        raise ValueError("Expected the first three octets of a private IPv4 /24, e.g. "
                         f"'10.213.0'. Received: subnet={subnet!r}")


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: list[str]) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"Command failed while building the emulated cluster: "
                           f"{' '.join(argv)}. Received: exit {res.returncode}, "
                           f"stderr={res.stderr.strip()!r}")


def _terminate(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _kill_namespace_pids(ns: str) -> None:
    # Grandchildren of our own processes may still live in the namespace and
    # would keep it (and its veths) alive after the name is deleted.
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                         check=False).stdout
    for pid in (int(p) for p in out.split() if p.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _owner_pid(name: str, prefix: str) -> int | None:
    digits = name[len(prefix):].split("x", 1)[0]
    return int(digits) if digits.isdigit() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
