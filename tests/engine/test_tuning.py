"""The engine's own choices: auto partition size, mixed-mode shares, BytePS's rank rules,
hierarchical auto. Pure functions first, then the in-process cluster."""

import numpy as np
import pytest

from bpstrain import _core

from .harness import InProcessCluster, push_pull

KB, MB = 1 << 10, 1 << 20
MBIT = 1e6 / 8  # bytes/s of 1 Mbit/s


@pytest.mark.parametrize("rate_mbit, expected", [
    (100, 64 * KB),      # 2.5 ms of a 100 Mbit/s link is 31 KB: the floor
    (500, 152 * KB),     # 156 KB, in pages
    (1000, 304 * KB),
    (10_000, 3048 * KB),
    (100_000, 4 * MB),   # 31 MB: the ceiling
    (0, 4 * MB),         # unknown link: the largest
])
def test_auto_partition_follows_the_link(rate_mbit, expected):
    assert _core.auto_partition_bytes(rate_mbit * MBIT, 1 << 30, 4) == expected


def test_auto_partition_gives_every_server_several_pieces_of_a_small_tensor():
    # 4 MB over 4 servers: at most 1/16 of a server's 1 MB share, even on a fast link.
    assert _core.auto_partition_bytes(100_000 * MBIT, 4 * MB, 4) == 64 * KB
    assert _core.auto_partition_bytes(100_000 * MBIT, 4 * MB, 1) == 256 * KB
    assert _core.auto_partition_bytes(100_000 * MBIT, 64 * MB, 4) == MB
    # Tiny tensors stay whole-element multiples of the floor.
    assert _core.auto_partition_bytes(100 * MBIT, 4 * KB, 4) == 64 * KB


@pytest.mark.parametrize("rate_mbit, expected", [(100, 16 * KB), (500, 78125), (2000, 312500),
                                                  (100_000, 4 * MB),
                                                  (0, 128 * KB)])
def test_auto_send_buffer_is_a_few_ms_of_the_link(rate_mbit, expected):
    assert _core.auto_socket_send_buffer(rate_mbit * MBIT, 100e-6) == expected
    # 8 connections into one link (8 servers, or 8 workers into one server): half each.
    assert _core.auto_socket_send_buffer(1000 * MBIT, 100e-6, peers=8) == 78125
    # A long round trip needs two of them in flight.
    assert _core.auto_socket_send_buffer(100 * MBIT, 0.05) == int(2 * 100 * MBIT * 0.05)


def test_auto_partition_holds_whole_elements():
    part = _core.auto_partition_bytes(800 * MBIT, 1 << 30, 4, elem_bytes=12)
    assert part % 12 == 0 and 200 * KB < part < 300 * KB


def _dedicated_share(n, k):
    hosts = [f"w{i}" for i in range(n)]
    servers = hosts + [f"s{j}" for j in range(k)]
    share = _core.mixed_shares(servers, hosts)
    assert sum(share) == pytest.approx(1.0)
    return sum(share[n:])


@pytest.mark.parametrize("n, k", [(4, 0), (4, 1), (4, 2), (4, 3), (8, 2), (8, 8)])
def test_mixed_shares_are_bytepss_optimum(n, k):
    # x = 2k(n-1) / (n(n+k) - 2k) of the bytes on the dedicated servers.
    assert _dedicated_share(n, k) == pytest.approx(2 * k * (n - 1) / (n * (n + k) - 2 * k))


def test_mixed_shares_balance_the_slowest_link():
    n, k = 4, 2
    hosts = [f"w{i}" for i in range(n)]
    share = _core.mixed_shares(hosts + ["s0", "s1"], hosts)
    y, z = share[0], share[n]
    colocated_link = (1 - y) + (n - 1) * y  # pushes out + this server's replies out
    dedicated_link = n * z                  # every worker's pushes in
    assert colocated_link == pytest.approx(dedicated_link)
    assert colocated_link == pytest.approx(2 * (n - 1) / (n + k - 2 * k / n))


def test_mixed_shares_fall_back_to_equal_shares():
    assert _core.mixed_shares(["w0", "s0"], ["w0", "w1"], mixed=False) == [0.5, 0.5]
    assert _core.mixed_shares(["s0", "s1"], ["w0", "w1"]) == [0.5, 0.5]  # none co-located
    assert _core.mixed_shares(["h", "h"], ["h"]) == [0.5, 0.5]            # one host
    # Two servers on one dedicated host split that host's share.
    share = _core.mixed_shares(["w0", "w1", "s", "s"], ["w0", "w1"])
    assert share[2] == share[3] and sum(share) == pytest.approx(1.0)
    assert share[2] + share[3] == pytest.approx(_dedicated_share(2, 1))


@pytest.mark.timeout(60)
def test_auto_partitions_come_from_the_measured_link():
    with InProcessCluster(2, 2) as c:
        for w in c.workers:
            assert w.link_bytes_per_s > 0 and w.link_rtt_s > 0
        big = np.ones(16 * MB // 4, np.float32)
        out = c.run_all(lambda r, w: push_pull(w, "big", big))
        assert all((o == 2).all() for o in out)
        parts = c.workers[0].partitions("big")
        assert parts == c.workers[1].partitions("big")
        expected = _core.auto_partition_bytes(min(w.link_bytes_per_s for w in c.workers),
                                              16 * MB, 2, 4)
        assert parts[0][1] == expected
        assert sum(p[1] for p in parts) == 16 * MB
        assert {p[2] for p in parts} == {0, 1}


@pytest.mark.timeout(60)
def test_partition_bytes_override_skips_the_probe_of_partitions():
    with InProcessCluster(2, 1, partition_bytes=64 * KB, credit_bytes=MB,
                          socket_send_buffer=128 * KB) as c:
        assert all(w.link_bytes_per_s == 0 for w in c.workers)  # nothing left to measure
        x = np.ones(300 * KB // 4, np.float32)
        c.run_all(lambda r, w: push_pull(w, "x", x))
        assert [p[1] for p in c.workers[0].partitions("x")] == [64 * KB] * 4 + [44 * KB]


@pytest.mark.timeout(60)
def test_auto_credit_keeps_two_partitions_per_server_in_flight():
    # Four 1 MiB partitions would leave a server idle: 4 servers x 2 x 1 MiB.
    with InProcessCluster(2, 4, partition_bytes=MB) as c:
        for w in c.workers:
            bdp = int(2 * w.link_bytes_per_s * w.link_rtt_s)
            assert w.credit_bytes == max(8 * MB, bdp)


@pytest.mark.timeout(60)
def test_mixed_mode_places_bytes_by_host():
    # 4 worker hosts, each with a server, plus one dedicated server host: 1/3 dedicated.
    hosts = ["a", "b", "c", "d"]
    with InProcessCluster(4, 5, worker_hosts=hosts, server_hosts=hosts + ["dedicated"],
                          partition_bytes=64 * KB) as c:
        x = np.ones(24 * MB // 4, np.float32)
        c.run_all(lambda r, w: push_pull(w, "x", x))
        per_server = np.zeros(5)
        for _, nbytes, server in c.workers[0].partitions("x"):
            per_server[server] += nbytes
        share = per_server / per_server.sum()
        assert share[4] == pytest.approx(1 / 3, abs=0.01)
        assert share[:4] == pytest.approx([1 / 6] * 4, abs=0.01)


@pytest.mark.timeout(60)
def test_mixed_mode_off_balances_servers_equally():
    hosts = ["a", "b"]
    with InProcessCluster(2, 3, worker_hosts=hosts, server_hosts=hosts + ["dedicated"],
                          partition_bytes=64 * KB, mixed_mode=False) as c:
        x = np.ones(6 * MB // 4, np.float32)
        c.run_all(lambda r, w: push_pull(w, "x", x))
        per_server = np.zeros(3)
        for _, nbytes, server in c.workers[0].partitions("x"):
            per_server[server] += nbytes
        assert per_server == pytest.approx([2 * MB] * 3, rel=0.02)


@pytest.mark.timeout(60)
def test_scheduler_counts_hosts_times_local_size():
    # DMLC_NUM_WORKER = 2 hosts; every worker says BYTEPS_LOCAL_SIZE = 2: 4 workers.
    with InProcessCluster(4, 1, local_size=2, hierarchical=0) as c:
        assert [w.size for w in c.workers] == [4] * 4
        assert sorted(w.rank for w in c.workers) == [0, 1, 2, 3]
        x = np.ones(8, np.float32)
        out = c.run_all(lambda r, w: push_pull(w, "x", x))
        assert all((o == 4).all() for o in out)


@pytest.mark.timeout(60)
def test_workers_with_different_local_sizes_are_refused():
    # BYTEPS_LOCAL_SIZE=2 in the scheduler's environment: a host of 3 does not fit.
    sched = _core.Scheduler(2, 1, host="127.0.0.1", port=0, rendezvous_timeout=5, local_size=2)
    sched.start()
    odd = _core.Worker("127.0.0.1", sched.port, rank_hint=0, local_size=3, numa="off",
                       rendezvous_timeout=5)
    try:
        odd.start()
        with pytest.raises(ValueError, match=r"BYTEPS_LOCAL_SIZE=2\. Received: BYTEPS_LOCAL_SIZE=3"):
            while not odd.wait_ready(0.1):
                pass
    finally:
        odd.shutdown()
        sched.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, expected", [(2, [True, True]), (0, [False, False])])
def test_hierarchical_auto_is_on_for_workers_that_share_a_host(mode, expected):
    with InProcessCluster(2, 1, local_size=2, hierarchical=mode) as c:
        assert [w.hierarchical for w in c.workers] == expected
        x = np.arange(16, dtype=np.float32)
        out = c.run_all(lambda r, w: push_pull(w, "x", x))
        assert all((o == 2 * x).all() for o in out)


@pytest.mark.timeout(60)
def test_hierarchical_auto_stays_flat_when_ranks_are_not_bytepss():
    # local_size 2 but ranks assigned by arrival (no DMLC_WORKER_ID): auto falls back.
    with InProcessCluster(2, 1, local_size=2, hierarchical=2, assign_ranks=True) as c:
        assert [w.hierarchical for w in c.workers] == [False, False]
