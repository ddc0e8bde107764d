"""The worker's partition scheduling policy on its own: no sockets, no threads."""

from bpstrain import _core


def drain(policy, servers):
    """Pops every ready push in the order one sender per server would, completing each
    push at once; returns (key, server) in send order."""
    out = []
    while True:
        ready = [s for s in range(servers) if policy.ready(s)]
        if not ready:
            return out
        assert len(ready) == 1, ready  # one global order: only the most urgent head may go
        key, _, _, nbytes, server, _ = policy.pop(ready[0])
        out.append((key, server))
        policy.done(nbytes)


def test_higher_priority_goes_first_across_servers():
    p = _core.SendPolicy(2, True, 1 << 20)
    p.add_op(0x100, 0, -5, [(0, 10, 0), (10, 10, 1)], rank=0)  # a back layer
    p.add_op(0x200, 0, -1, [(0, 10, 1), (10, 10, 0)], rank=0)  # a front layer, later
    order = [key for key, _ in drain(p, 2)]
    assert order[:2] == [0x200 | 1, 0x200 | 0] or order[:2] == [0x200 | 0, 0x200 | 1]
    assert set(order[2:]) == {0x100, 0x101}


def test_without_priority_first_come_first_served():
    p = _core.SendPolicy(2, False, 1 << 20)
    p.add_op(0x100, 0, -5, [(0, 10, 0), (10, 10, 1)], rank=0)
    p.add_op(0x200, 0, -1, [(0, 10, 1), (10, 10, 0)], rank=0)
    assert [key >> 8 for key, _ in drain(p, 2)] == [1, 1, 2, 2]


def test_credit_bounds_the_bytes_in_flight():
    p = _core.SendPolicy(1, True, 250)
    p.add_op(0x100, 0, 0, [(i * 100, 100, 0) for i in range(5)], rank=0)
    p.pop(0)
    p.pop(0)
    assert p.bytes_in_flight == 200 and not p.ready(0)  # a third would exceed 250
    p.done(100)
    assert p.ready(0)


def test_one_push_may_always_go_when_nothing_is_in_flight():
    p = _core.SendPolicy(1, True, 10)
    p.add_op(0x100, 0, 0, [(0, 1000, 0)], rank=0)
    assert p.ready(0)
    p.pop(0)
    assert p.bytes_in_flight == 1000


def test_the_global_order_holds_back_a_less_urgent_head():
    p = _core.SendPolicy(2, True, 1 << 20)
    p.add_op(0x100, 0, 0, [(0, 10, 0)], rank=0)
    p.add_op(0x200, 0, 0, [(0, 10, 1)], rank=0)
    assert p.ready(0) and not p.ready(1)  # server 1's head came later
    p.pop(0)
    assert p.ready(1)


def test_each_rank_starts_at_its_own_server():
    servers = [0, 1, 2, 3] * 2  # placement of 8 partitions on 4 servers
    for rank in range(4):
        order = _core.SendPolicy.spread_order(servers, rank, 4)
        assert [servers[i] for i in order] == [(rank + j) % 4 for j in range(4)] * 2


def test_a_server_with_more_partitions_is_fed_all_along():
    # Mixed mode: server 0 (dedicated) holds 6 partitions, server 1 holds 2.
    servers = [0, 0, 0, 1, 0, 0, 0, 1]
    order = [servers[i] for i in _core.SendPolicy.spread_order(servers, 0, 2)]
    first_half = order[:4]
    assert first_half.count(0) == 3 and first_half.count(1) == 1
