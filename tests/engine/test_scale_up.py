"""Scale-up (comm.fault_tolerance with comm.max_workers): a worker that registers after
the rendezvous when no departed worker's place is free gets a new rank, joins at the
others' next admission, and from then on its gradients count (the scheduler's
JoinLaterLocked/TryAdmitLocked, the membership notice's size, the servers' and workers'
OnMembership). Over TCP, in-process and UCX, with data-connection credentials."""

import contextlib
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from bpstrain import _core
from bpstrain.errors import ConfigError
from tests.engine.harness import InProcessCluster, push_pull
from tests.engine.test_fault_tolerance import admit_until_joined, joiner
from tests.engine.test_faults import PUSH, FakeWorker

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("transport")]


def step(workers):
    """One step of every worker: a tensor of before the join, a new one, a broadcast."""
    def one(w):
        g = push_pull(w, "g", np.full(4, w.rank + 1.0, np.float32))
        h = push_pull(w, f"h{len(workers)}", np.full(2, 10.0 * (w.rank + 1), np.float32), op=1)
        b = push_pull(w, "b", np.full(3, 7.0 if w.membership()["live_rank"] == 0 else -1.0, np.float32),
                      op=2, root=0)
        return g, h, b

    with ThreadPoolExecutor(len(workers)) as pool:
        return list(pool.map(one, workers))


@contextlib.contextmanager
def growing_job(**kwargs):
    """A fault-tolerant in-process job of 2 workers and 1 server, and the list the test
    puts its joiners in; all shut down when the test ends."""
    c = InProcessCluster(2, 1, fault_tolerance=True, **kwargs)
    new = []
    try:
        yield c, new
    finally:
        for w in new:
            w.shutdown()
        c.close()


def test_new_workers_join_a_full_job_up_to_max_workers_and_their_gradients_count():
    with growing_job(max_workers=4, secret="scale-up secret") as (c, new):
        res = c.run_all(lambda r, w: push_pull(w, "g", np.full(4, r + 1.0, np.float32)))
        assert all(np.array_equal(x, np.full(4, 3.0, np.float32)) for x in res)
        new.append(joiner(c))
        assert not new[0].wait_ready(0.3)  # welcomed with a new rank, waiting for an admission
        assert new[0].rank == 2
        admit_until_joined(c.workers, [2])
        assert new[0].wait_ready(10)
        everyone = [*c.workers, *new]
        for w in everyone:
            m = w.membership()
            assert (m["live_size"], m["live_rank"], list(m["departed"]), list(m["joined"])) == (3, w.rank, [], [2])
            assert w.size == 3
        assert new[0].membership()["admitted_late"]
        for g, h, b in step(everyone):
            assert np.array_equal(g, np.full(4, 6.0, np.float32))  # 1 + 2 + 3: the new rank counts
            assert np.array_equal(h, np.full(2, 20.0, np.float32))  # (10 + 20 + 30) / 3
            assert np.array_equal(b, np.full(3, 7.0, np.float32))
        # A fourth, asking for its rank; then the job is at comm.max_workers.
        new.append(joiner(c, rank_hint=3))
        assert not new[1].wait_ready(0.3)
        admit_until_joined(everyone, [3])
        assert new[1].wait_ready(10)
        everyone = [*c.workers, *new]
        assert [w.membership()["live_size"] for w in everyone] == [4] * 4
        for g, h, b in step(everyone):
            assert np.array_equal(g, np.full(4, 10.0, np.float32))
            assert np.array_equal(h, np.full(2, 25.0, np.float32))
            assert np.array_equal(b, np.full(3, 7.0, np.float32))
        late = joiner(c)
        with pytest.raises(ConfigError, match=r"already has all 4 workers.*up to comm.max_workers \(4\)"):
            while not late.wait_ready(0.1):
                pass
        late.shutdown()


def test_a_rank_a_joiner_skipped_is_a_free_place_and_the_job_counts_only_who_is_in():
    with growing_job(max_workers=4) as (c, new):
        new.append(joiner(c, rank_hint=3))  # skips rank 2
        admit_until_joined(c.workers, [3])
        assert new[0].wait_ready(10)
        everyone = [*c.workers, *new]
        for w in everyone:
            m = w.membership()
            assert (m["live_size"], list(m["departed"])) == (3, [2]), m
        assert [w.membership()["live_rank"] for w in everyone] == [0, 1, 2]
        for g, h, b in step(everyone):
            assert np.array_equal(g, np.full(4, 1.0 + 2.0 + 4.0, np.float32))
            assert np.array_equal(h, np.full(2, (10.0 + 20.0 + 40.0) / 3, np.float32))
        new.append(joiner(c))  # takes the free rank 2, as the place of a departed worker
        admit_until_joined(everyone, [2])
        assert new[1].wait_ready(10) and new[1].rank == 2
        everyone = [*c.workers, *new]
        assert all((w.membership()["live_size"], list(w.membership()["departed"])) == (4, []) for w in everyone)
        for g, _h, _b in step(everyone):
            assert np.array_equal(g, np.full(4, 10.0, np.float32))


def test_a_new_rank_that_pushes_before_its_admission_is_refused_and_nothing_merged():
    c = InProcessCluster(2, 1, fault_tolerance=True, max_workers=3)
    try:
        fake = FakeWorker(c, -1)  # registers now: a new rank, waiting to join
        fake.welcome()
        assert fake.rank == 2
        data = fake.data_link()  # its credential is one the server holds (up to max_workers)
        # A round of the 2 workers in the job (one of 3 would name more workers than the
        # server knows of: a malformed frame, the link drops).
        data.send(PUSH, struct.pack("<I", 2), body=np.ones(4, np.float32).tobytes(),
                  key=0, version=1, arg=16, flags=2 << 8, sender=2)
        reply = data.recv(10)
        assert reply is not None and b"before the job admitted it" in reply[4], reply
        res = c.run_all(lambda r, w: push_pull(w, "g", np.full(4, r + 1.0, np.float32)))
        assert all(np.array_equal(x, np.full(4, 3.0, np.float32)) for x in res), res
        fake.link.shutdown()
    finally:
        c.close()


def test_max_workers_needs_fault_tolerance():
    with pytest.raises(ConfigError, match="comm.max_workers .* needs comm.fault_tolerance"):
        _core.Scheduler(2, 1, max_workers=4)
