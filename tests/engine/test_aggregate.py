"""k-of-n aggregation (comm.aggregate k:K, backup workers): a round is answered once K
workers pushed it, averaged over those K; a late push gets the same answer and is
dropped; the fastest workers run at most a few rounds ahead of the slowest."""

import threading
import time

import numpy as np
import pytest

from bpstrain import _core
from bpstrain.errors import BpsError, ConfigError
from tests.engine.harness import InProcessCluster, push_pull, wait

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("transport")]

SUM, AVERAGE, BROADCAST = 0, 1, 2
LATE_ROUNDS = 4  # Server::kMaxLateRounds


def contribution(rank, n=300):
    return np.full(n, rank + 1, np.float32)


def declare(w, name, shape):
    """Declares `name` and waits for its placement: a tensor's first use waits for every
    worker (the scheduler checks that all ranks agree on it), k-of-n or not."""
    w.declare(name, "float32", list(shape))
    deadline = time.monotonic() + 20
    while not w.partitions(name):
        assert time.monotonic() < deadline, f"{name} was never placed"
        time.sleep(0.01)


def test_three_of_four_answer_without_the_slowest_and_it_gets_the_same_answer():
    with InProcessCluster(4, 2, partition_bytes=256, aggregate=3) as c:
        fast_done = threading.Barrier(3)
        slow_may_push = threading.Event()

        def job(rank, w):
            declare(w, "g", [300])
            if rank == 3:
                assert slow_may_push.wait(20)
            out = push_pull(w, "g", contribution(rank), op=AVERAGE)
            if rank != 3 and fast_done.wait(20) == 0:
                slow_may_push.set()
            return out, w.stats()["late_partitions"]

        res = c.run_all(job)
        for out, _ in res:  # ranks 0..2 pushed first: their mean, on every rank
            np.testing.assert_array_equal(out, np.full(300, 2.0, np.float32))
        assert [late for _, late in res[:3]] == [0, 0, 0]
        assert res[3][1] == len(c.workers[3].partitions("g")) > 1  # every partition was late
        assert sum(s.stats()["pending_rounds"] for s in c.servers) == 0  # answers forgotten


def test_a_sum_adds_the_first_k_pushes_and_a_broadcast_still_waits_for_everyone():
    with InProcessCluster(3, 1, aggregate=2) as c:
        order = [threading.Event() for _ in range(3)]
        order[0].set()

        def job(rank, w):
            declare(w, "s", [5])
            assert order[rank].wait(20)
            x, out = contribution(rank, 5), np.empty(5, np.float32)  # alive until the op is done
            h = w.enqueue("s", "float32", [5], x, out, SUM)
            if rank == 0:
                order[1].set()
            if rank == 1:
                wait(w, h)  # ranks 0 and 1 completed the round; rank 2 pushes after
                order[2].set()
            else:
                wait(w, h)
            b = push_pull(w, "b", np.full(3, float(rank), np.float32), op=BROADCAST, root=2)
            return out, b

        for out, b in c.run_all(job):
            np.testing.assert_array_equal(out, np.full(5, 3.0, np.float32))  # 1 + 2
            np.testing.assert_array_equal(b, np.full(3, 2.0, np.float32))


def test_the_fastest_wait_once_the_slowest_is_too_many_rounds_behind():
    with InProcessCluster(3, 1, aggregate=2) as c:
        release = threading.Event()
        completed = [0, 0]

        def job(rank, w):
            declare(w, "t", [4])
            if rank == 2:
                assert release.wait(20)
                outs = [push_pull(w, "t", np.full(4, 10.0 * v, np.float32), op=AVERAGE)
                        for v in range(LATE_ROUNDS + 2)]
                return outs, w.stats()["late_partitions"]
            outs = []
            for v in range(LATE_ROUNDS + 2):
                outs.append(push_pull(w, "t", np.full(4, v + rank, np.float32), op=AVERAGE))
                completed[rank] += 1
            return outs, w.stats()["late_partitions"]

        def let_slow_go():
            deadline = time.monotonic() + 20
            while min(completed) < LATE_ROUNDS and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.5)  # the fast ranks' next round is held now, not answered
            snapshot = list(completed)
            release.set()
            return snapshot

        snap = []
        t = threading.Thread(target=lambda: snap.append(let_slow_go()))
        t.start()
        res = c.run_all(job)
        t.join()
        assert snap == [[LATE_ROUNDS, LATE_ROUNDS]], "the fast ranks ran past the lag bound"
        for outs, _ in res[1:]:  # every rank applied the same answers, in the same order
            for got, want in zip(outs, res[0][0]):
                np.testing.assert_array_equal(got, want)
        # The rounds the fast ranks finished (or had held) before the slow one came: theirs.
        for v, got in enumerate(res[0][0][:LATE_ROUNDS + 1]):
            np.testing.assert_array_equal(got, np.full(4, v + 0.5, np.float32))
        # The last round: whichever two pushed it first (the slow rank catches up at once,
        # its older rounds being answered from the kept results).
        v = LATE_ROUNDS + 1
        assert float(res[0][0][v][0]) in {(v + v + 1) / 2, (v + 10.0 * v) / 2, (v + 1 + 10.0 * v) / 2}
        assert res[2][1] >= LATE_ROUNDS + 1 and res[0][1] + res[1][1] <= 1


def test_all_is_synchronous_and_k_equal_to_n_is_the_same():
    for aggregate in (0, 3):
        with InProcessCluster(3, 2, partition_bytes=128, aggregate=aggregate) as c:
            res = c.run_all(lambda rank, w: push_pull(w, "a", contribution(rank, 100), op=AVERAGE))
            for out in res:
                np.testing.assert_array_equal(out, np.full(100, 2.0, np.float32))


def test_k_of_n_refuses_what_it_cannot_do():
    with InProcessCluster(2, 1, aggregate=1) as c:
        def job(rank, w):
            blob = np.zeros(64, np.uint8)
            with pytest.raises(ConfigError, match="does not combine with compression"):
                w.enqueue("c", "compressed", [64], blob, blob, SUM)
            return True
        assert all(c.run_all(job))
    sched = _core.Scheduler(2, 1, host="127.0.0.1", port=0, rendezvous_timeout=5)
    sched.start()
    try:
        server = _core.Server("127.0.0.1", sched.port, listen_host="127.0.0.1", numa="off", rendezvous_timeout=5)
        server.start()
        workers = [_core.Worker("127.0.0.1", sched.port, rank_hint=i, numa="off", rendezvous_timeout=5,
                                aggregate=3) for i in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            with pytest.raises(ConfigError, match=r"comm.aggregate k:3 needs K <= the 2 workers"):
                while not w.wait_ready(0.1):
                    pass
        for w in workers:
            w.shutdown()
        server.stop()
    finally:
        sched.stop()
    with pytest.raises(ConfigError, match="aggregate must be >= 0"):
        _core.Worker("127.0.0.1", 9, aggregate=-1)


def test_a_worker_behind_catches_up_with_pulls_that_do_not_count():
    with InProcessCluster(3, 2, partition_bytes=256, aggregate=2) as c:
        fast_done = threading.Barrier(2)
        slow_may_go = threading.Event()

        def job(rank, w):
            declare(w, "c", [300])
            if rank < 2:  # three rounds without rank 2
                outs = [push_pull(w, "c", np.full(300, 10.0 * v + rank, np.float32), op=AVERAGE)
                        for v in range(3)]
                if fast_done.wait(20) == 0:
                    slow_may_go.set()
                return outs, w.rounds_behind("c")
            assert slow_may_go.wait(20)
            assert w.rounds_behind("c") == 0  # it has not heard from the servers yet
            outs = [push_pull(w, "c", np.full(300, 99.0, np.float32), op=AVERAGE)]  # late: round 0
            behind = w.rounds_behind("c")
            for _ in range(behind):  # rounds 1 and 2: take the answers, contribute nothing
                dummy, out = np.full(300, 1e6, np.float32), np.empty(300, np.float32)
                wait(w, w.enqueue("c", "float32", [300], dummy, out, AVERAGE, pull_only=True))
                outs.append(out)
            return outs, (behind, w.rounds_behind("c"), w.stats()["late_partitions"])

        res = c.run_all(job)
        expect = [np.full(300, 10.0 * v + 0.5, np.float32) for v in range(3)]
        for outs, _ in res:
            assert len(outs) == 3
            for got, want in zip(outs, expect):
                np.testing.assert_array_equal(got, want)
        assert res[0][1] == res[1][1] == 0
        behind, after, late = res[2][1]
        assert (behind, after) == (2, 0) and late == 3 * len(c.workers[2].partitions("c"))
        assert sum(s.stats()["pending_rounds"] for s in c.servers) == 0


def test_catch_up_pulls_are_refused_where_they_could_count():
    with InProcessCluster(2, 1, aggregate=1) as c:
        def job(rank, w):
            declare(w, "p", [4])
            x, out = np.ones(4, np.float32), np.empty(4, np.float32)
            if rank == 0:  # round 0 is not answered: a pull may not open or join it
                with pytest.raises(BpsError, match="catch-up pull for a round this server does not keep"):
                    wait(w, w.enqueue("p", "float32", [4], x, out, AVERAGE, pull_only=True))
            with pytest.raises(ConfigError, match="needs k-of-n aggregation"):
                w.enqueue("p", "float32", [4], x, out, BROADCAST, pull_only=True)
            return True
        assert all(c.run_all(job))
    with InProcessCluster(2, 1) as c:
        with pytest.raises(ConfigError, match="needs k-of-n aggregation"):
            x = np.ones(4, np.float32)
            c.workers[0].enqueue("q", "float32", [4], x, x, AVERAGE, pull_only=True)
