"""Emulated cluster: link caps hold, nothing touches the root namespace, nothing leaks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from bpstrain.bench import emulated
from bpstrain.bench.emulated import EmulatedCluster, cleanup_stale, list_namespaces

_OK, _REASON = emulated.available()
pytestmark = pytest.mark.skipif(not _OK, reason=_REASON)

_PROBE = [sys.executable, "-m", "bpstrain.bench._tcp_probe"]


def _env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(emulated.__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}


def _throughput_mbit(cluster, senders, receiver, nbytes, port=5001) -> float:
    """Mbit/s that ``receiver`` gets while every host in ``senders`` sends ``nbytes``."""
    recv = cluster.popen(receiver, [*_PROBE, "recv", "--host", cluster.addr(receiver),
                                    "--port", str(port), "--conns", str(len(senders))],
                         env=_env(), stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "READY"
    procs = [cluster.popen(s, [*_PROBE, "send", "--host", cluster.addr(receiver),
                               "--port", str(port), "--bytes", str(nbytes)], env=_env())
             for s in senders]
    assert [p.wait(timeout=60) for p in procs] == [0] * len(procs)
    out, _ = recv.communicate(timeout=60)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bytes"] == nbytes * len(senders)
    return result["mbit_s"]


def _root_view() -> tuple[set, set, str]:
    """Root namespace's interface names, (device, address) pairs and IPv4 routes."""
    def run(*args):
        return subprocess.run(["ip", *args], capture_output=True, text=True).stdout
    links = {line.split(":")[1].strip().split("@")[0] for line in run("-o", "link").splitlines()}
    addrs = {tuple(line.split()[1:4:2]) for line in run("-o", "addr").splitlines()}
    return links, addrs, run("route")


@pytest.mark.timeout(90)
def test_upload_is_capped_near_configured_rate():
    with EmulatedCluster(2, rate_mbit=200) as cluster:
        mbit = _throughput_mbit(cluster, [0], 1, nbytes=15_000_000)
    assert 0.5 * 200 <= mbit <= 1.2 * 200, mbit


@pytest.mark.timeout(90)
def test_download_cap_limits_a_faster_sender():
    # Host 0 may upload 400 Mbit/s but host 1 may only download 100.
    with EmulatedCluster(2, rate_mbit=[400, 100]) as cluster:
        mbit = _throughput_mbit(cluster, [0], 1, nbytes=7_500_000)
    assert 0.5 * 100 <= mbit <= 1.2 * 100, mbit


@pytest.mark.timeout(90)
def test_two_senders_share_one_download():
    with EmulatedCluster(3, rate_mbit=150) as cluster:
        mbit = _throughput_mbit(cluster, [0, 1], 2, nbytes=5_000_000)
    assert 0.5 * 150 <= mbit <= 1.2 * 150, mbit


@pytest.mark.timeout(60)
def test_root_namespace_untouched_and_hosts_have_no_way_out():
    before = _root_view()
    with EmulatedCluster(2, rate_mbit=100) as cluster:
        assert _root_view() == before
        routes = subprocess.run(["ip", "-n", cluster.netns(0), "route"],
                                capture_output=True, text=True).stdout.strip().splitlines()
        assert routes == [f"10.213.0.0/24 dev {cluster.ifname} proto kernel scope link "
                          f"src {cluster.addr(0)}"]
        lo = subprocess.run(["ip", "-n", cluster.netns(1), "-o", "link", "show", "lo"],
                            capture_output=True, text=True).stdout
        assert "UP" in lo
    assert _root_view() == before


@pytest.mark.timeout(60)
def test_close_removes_namespaces_and_processes():
    cluster = EmulatedCluster(2, rate_mbit=100)
    assert len(list_namespaces(cluster.name)) == 3
    sleeper = cluster.popen(1, [sys.executable, "-c", "import time; time.sleep(600)"])
    cluster.close()
    assert sleeper.poll() is not None
    assert list_namespaces(cluster.name) == []
    cluster.close()  # idempotent


@pytest.mark.timeout(60)
def test_exception_inside_with_block_removes_namespaces():
    with pytest.raises(KeyError):
        with EmulatedCluster(2, rate_mbit=100) as cluster:
            name = cluster.name
            raise KeyError("boom")
    assert list_namespaces(name) == []


@pytest.mark.timeout(60)
def test_failed_build_removes_what_was_created(monkeypatch):
    mine = f"{emulated.DEFAULT_PREFIX}{os.getpid()}x"
    before = list_namespaces(mine)
    real_run = emulated._run

    def failing_tc(argv):
        if argv[0] == "tc":  # fails after the namespaces and veths exist
            raise RuntimeError("tc refused. Received: test")
        real_run(argv)

    monkeypatch.setattr(emulated, "_run", failing_tc)
    with pytest.raises(RuntimeError, match="tc refused"):
        EmulatedCluster(2, rate_mbit=100)
    assert list_namespaces(mine) == before


@pytest.mark.parametrize("kwargs", [
    {"hosts": 0, "rate_mbit": 100}, {"hosts": 2, "rate_mbit": [100]},
    {"hosts": 2, "rate_mbit": -1}, {"hosts": 2, "rate_mbit": 100, "subnet": "8.8.8"},
    {"hosts": 2, "rate_mbit": 100, "subnet": "10.213.999"},
])
def test_bad_arguments_are_rejected_before_building(kwargs):
    with pytest.raises(ValueError, match="Received"):
        EmulatedCluster(**kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_removes_namespaces_in_child_process(signum):
    script = textwrap.dedent("""
        import sys, time
        from bpstrain.bench.emulated import EmulatedCluster
        cluster = EmulatedCluster(2, rate_mbit=100)
        print(cluster.name, flush=True)
        sys.stdin.read()  # blocks until the parent's signal
    """)
    child = subprocess.Popen([sys.executable, "-c", script], env=_env(), text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        name = child.stdout.readline().strip()
        assert name and list_namespaces(name)
        child.send_signal(signum)
        _, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    # Chaining: SIGINT still raises KeyboardInterrupt, SIGTERM still terminates.
    if signum == signal.SIGINT:
        assert "KeyboardInterrupt" in err
    else:
        assert child.returncode == -signal.SIGTERM
    assert list_namespaces(name) == []


@pytest.mark.timeout(60)
def test_cleanup_stale_deletes_only_dead_owners():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    prefix = "bpsbtest"
    stale, alive = f"{prefix}{dead.pid}x0-sw", f"{prefix}{os.getpid()}x0-sw"
    for name in (stale, alive):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert cleanup_stale(prefix) == [stale]
        assert list_namespaces(prefix) == [alive]
    finally:
        for name in list_namespaces(prefix):
            subprocess.run(["ip", "netns", "del", name], check=False)
