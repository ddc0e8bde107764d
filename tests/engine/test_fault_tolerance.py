"""comm.fault_tolerance in the engine: a worker that dies or hangs leaves the job and the
others go on (core_ext/src/server_membership.cc, worker_membership.cc, the scheduler's
DepartLocked). The departing worker is a FakeWorker of test_faults.py (a registered
worker the test plays), so the fault is deterministic; without fault tolerance the same
faults fail the job (test_faults.py)."""

import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from bpstrain import _core
from bpstrain.errors import BpsError, ConfigError, PeerError
from tests.engine.harness import InProcessCluster, push_pull, wait
from tests.engine.test_faults import HEARTBEAT, PUSH, FakeWorker

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("transport")]
MEMBERSHIP = 22


def cluster_with_a_fake(**kwargs):
    """Two real workers (ranks 0, 1) and a fake one (rank 2), fault tolerance on."""
    fakes = []
    c = InProcessCluster(2, 1, extra_workers=1, fault_tolerance=True,
                         before_ready=lambda c: fakes.append(FakeWorker(c, 2)), **kwargs)
    fakes[0].welcome()
    return c, fakes[0]


def test_a_worker_that_dies_leaves_and_the_others_average_over_themselves():
    c, fake = cluster_with_a_fake()
    with c:
        fake.link.shutdown()  # dies: its connection drops, it never declared nor pushed
        t0 = time.monotonic()
        res = c.run_all(lambda r, w: push_pull(w, "g", np.full(6, r + 1.0, np.float32), op=1))
        assert all(np.array_equal(x, np.full(6, 1.5, np.float32)) for x in res), res  # (1 + 2) / 2
        assert time.monotonic() - t0 < 5
        for w in c.workers:
            m = w.membership()
            assert (m["epoch"], list(m["departed"]), m["live_size"], m["live_rank"]) == (1, [2], 2, w.rank)
            # The answer computed without worker 2 carries that membership to every rank.
            assert (m["answered_epoch"], list(m["answered_departed"])) == (1, [2])
        # The job goes on: sums, barriers and broadcasts among the two.
        res = c.run_all(lambda r, w: push_pull(w, "h", np.full(3, r + 1.0, np.float32), op=0))
        assert all(np.array_equal(x, np.full(3, 3.0, np.float32)) for x in res)

        def barrier_then_broadcast(r, w):
            wait(w, w.enqueue_barrier())
            return push_pull(w, "b", np.full(2, 10.0 * (r + 1), np.float32), op=2, root=1)

        assert all(np.array_equal(x, np.full(2, 20.0, np.float32)) for x in c.run_all(barrier_then_broadcast))


def test_a_worker_stopped_by_an_exception_leaves_too():
    c, fake = cluster_with_a_fake()
    with c:
        reason = b"ZeroDivisionError: bad batch"
        fake.send(8, struct.pack("<I", len(reason)) + reason)  # goodbye with a reason
        res = c.run_all(lambda r, w: push_pull(w, "g", np.full(2, r + 1.0, np.float32), op=1))
        assert all(np.array_equal(x, np.full(2, 1.5, np.float32)) for x in res)
        assert all(w.membership()["departed"] == [2] for w in c.workers)
        fake.link.shutdown()


def test_a_broadcast_whose_root_left_fails_clearly_and_the_job_goes_on():
    c, fake = cluster_with_a_fake()
    with c:
        handles = [w.enqueue("root2", "float32", [4], np.ones(4, np.float32), out, 2, 2, 0)
                   for w, out in zip(c.workers, [np.empty(4, np.float32) for _ in c.workers])]
        fake.link.shutdown()
        for w, h in zip(c.workers, handles):
            with pytest.raises(BpsError, match="its root, worker 2, left the job"):
                wait(w, h)
        res = c.run_all(lambda r, w: push_pull(w, "after", np.full(2, r + 1.0, np.float32), op=0))
        assert all(np.array_equal(x, np.full(2, 3.0, np.float32)) for x in res)


def test_a_hung_worker_is_left_behind_after_the_peer_timeout_and_its_pushes_are_refused():
    c, fake = cluster_with_a_fake(peer_timeout=2)
    with c:
        data = fake.data_link()  # then silence: no heartbeats, as a stopped process
        t0 = time.monotonic()
        res = c.run_all(lambda r, w: push_pull(w, "g", np.full(4, r + 1.0, np.float32), op=1))
        detected = time.monotonic() - t0
        assert all(np.array_equal(x, np.full(4, 1.5, np.float32)) for x in res)
        assert 1.5 < detected < 4.5, detected  # the 2 s peer timeout, checked every 0.2 s
        # It wakes up and pushes: refused with a clear error, nothing merged.
        data.send(PUSH, struct.pack("<III", 3, 0xFFFFFFFF, 3), body=np.ones(4, np.float32).tobytes(),
                  key=1, version=9, arg=16, flags=2 << 8, sender=2)
        reply = data.recv(10)
        assert reply is not None and b"left the job" in reply[4], reply
        notice = fake.link.recv(5)  # and the scheduler told it that it left
        assert notice is not None and notice[0] == MEMBERSHIP and struct.unpack_from("<qIIq", notice[4]) == (1, 3, 1, 2)
        fake.link.shutdown()


def test_the_job_ends_cleanly_when_the_others_said_goodbye_and_one_left():
    c, fake = cluster_with_a_fake()
    try:
        for w in c.workers:
            w.shutdown()  # goodbyes from the two; the job still waits for the third
        fake.link.shutdown()  # which leaves: nobody is left to wait for
        assert all(s.wait(5) for s in c.servers)  # terminated, not failed (wait raises on failure)
        assert c.scheduler.wait(5)
    finally:
        for s in c.servers:
            s.stop()
        c.scheduler.stop()


def test_without_fault_tolerance_the_same_death_still_fails_the_job():
    fakes = []
    c = InProcessCluster(2, 1, extra_workers=1, before_ready=lambda c: fakes.append(FakeWorker(c, 2)))
    fakes[0].welcome()
    fakes[0].link.shutdown()

    def job(rank, w):
        with pytest.raises(PeerError, match="worker 2"):
            push_pull(w, "x", np.ones(4, np.float32))
        return True

    assert all(c.run_all(job))
    with pytest.raises(PeerError):
        c.close()


def wait_for_scheduler_loss(workers, timeout=10):
    deadline = time.monotonic() + timeout
    while not all(w.membership()["scheduler_lost"] for w in workers):
        assert time.monotonic() < deadline, [w.membership() for w in workers]
        time.sleep(0.02)


def test_when_the_scheduler_dies_push_pull_goes_on_and_what_needs_it_fails_clearly():
    c = InProcessCluster(2, 2, fault_tolerance=True)
    try:
        c.run_all(lambda r, w: push_pull(w, "g", np.full(8, r + 1.0, np.float32)))
        c.scheduler.stop()  # its connections drop, as when the process dies
        wait_for_scheduler_loss(c.workers)
        for step in range(3):  # declared tensors keep going, over both servers
            res = c.run_all(lambda r, w: push_pull(w, "g", np.full(8, r + step, np.float32), op=1))
            assert all(np.array_equal(x, np.full(8, step + 0.5, np.float32)) for x in res), res

        def what_needs_the_scheduler(r, w):
            with pytest.raises(PeerError, match="a barrier needs the scheduler, which is gone"):
                wait(w, w.enqueue_barrier())
            with pytest.raises(PeerError, match="declaring tensor 'new'.*needs the scheduler"):
                push_pull(w, "new", np.ones(2, np.float32))
            with pytest.raises(PeerError, match="declaring tensor 'g'"):  # another shape: a new declaration
                push_pull(w, "g", np.ones(3, np.float32))
            return push_pull(w, "g", np.full(8, 2.0, np.float32))  # the engine did not fail

        assert all(np.array_equal(x, np.full(8, 4.0, np.float32)) for x in c.run_all(what_needs_the_scheduler))
        for w in c.workers:
            w.shutdown()  # goodbyes on the data connections: the servers end cleanly
        assert all(s.wait(5) for s in c.servers)  # True and no exception: not a failure
    finally:
        for s in c.servers:
            s.stop()
        c.scheduler.stop()


def test_a_worker_that_vanishes_while_the_scheduler_is_gone_ends_the_job_with_its_name():
    c, fake = cluster_with_a_fake()
    try:
        data = fake.data_link()  # connected to the server like the others
        c.scheduler.stop()
        wait_for_scheduler_loss(c.workers)
        data.shutdown()  # dies: no goodbye, and no scheduler to take it out of the job
        with pytest.raises(PeerError, match="worker 2 closed its connections without shutting down while the "
                                            "scheduler was gone"):
            c.servers[0].wait(5)
        c.servers[0].stop()  # its process exits: the workers' connections drop

        def job(rank, w):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with pytest.raises(PeerError) as e:
                    push_pull(w, "x", np.ones(4, np.float32))
                if "the scheduler is gone too" in str(e.value):  # the worker failed, saying why
                    return True
                time.sleep(0.05)
            return str(e.value)

        assert c.run_all(job) == [True, True]
    finally:
        for w in c.workers:
            w.shutdown()
        for s in c.servers:
            s.stop()
        c.scheduler.stop()


def test_a_worker_that_said_goodbye_while_the_scheduler_is_gone_is_not_a_failure():
    c, fake = cluster_with_a_fake()
    try:
        data = fake.data_link()
        c.scheduler.stop()
        wait_for_scheduler_loss(c.workers)
        data.send(8, b"", sender=2)  # kGoodbye on the data connection: a clean shutdown
        data.shutdown()
        time.sleep(0.2)
        assert not c.servers[0].wait(0.1)  # still serving the two others
        for w in c.workers:
            w.shutdown()
        assert c.servers[0].wait(5)
    finally:
        for s in c.servers:
            s.stop()
        c.scheduler.stop()


def test_without_fault_tolerance_the_scheduler_dying_fails_the_workers():
    c = InProcessCluster(2, 1)
    try:
        c.run_all(lambda r, w: push_pull(w, "g", np.ones(4, np.float32)))
        c.scheduler.stop()

        def job(rank, w):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    push_pull(w, "g", np.ones(4, np.float32))
                except PeerError as e:
                    return str(e)
                time.sleep(0.05)
            return None

        assert all(msg and "scheduler" in msg for msg in c.run_all(job))
        with pytest.raises(PeerError):
            c.servers[0].wait(5)
    finally:
        for w in c.workers:
            w.shutdown()
        for s in c.servers:
            s.stop()
        c.scheduler.stop()


def joiner(c, rank_hint=-1):
    """A real worker started after rendezvous: it waits to join in a free place."""
    w = _core.Worker("127.0.0.1", c.scheduler_port, rank_hint=rank_hint, rendezvous_timeout=20, numa="off",
                     fault_tolerance=True, transport=c.transport, secret=c.secret)
    w.start()
    return w


def admit_until_joined(workers, want, timeout=10):
    """Admissions among `workers` (between steps) until the joiners got in."""
    deadline = time.monotonic() + timeout
    while True:
        c_joined = [None] * len(workers)

        def admit(i, w):
            wait(w, w.enqueue_admission())
            c_joined[i] = list(w.membership()["joined"])

        threads = [threading.Thread(target=admit, args=(i, w)) for i, w in enumerate(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if c_joined == [want] * len(workers):
            return
        assert c_joined == [[]] * len(workers), c_joined  # every rank sees the same admission
        assert time.monotonic() < deadline, "nobody joined"
        time.sleep(0.05)


def test_a_worker_joins_in_the_place_of_a_hung_one_and_the_stale_process_is_refused():
    c, fake = cluster_with_a_fake(peer_timeout=2)
    new = None
    try:
        zombie = fake.data_link()  # then silence: declared gone after the peer timeout
        res = c.run_all(lambda r, w: push_pull(w, "g", np.full(4, r + 1.0, np.float32)))
        assert all(np.array_equal(x, np.full(4, 3.0, np.float32)) for x in res)  # 1 + 2: rank 2 left
        new = joiner(c, rank_hint=2)
        assert not new.wait_ready(0.3)  # welcomed, waiting for an admission
        admit_until_joined(c.workers, [2])
        assert new.wait_ready(10)
        m = new.membership()
        assert (m["admitted_late"], m["live_size"], m["live_rank"], list(m["departed"])) == (True, 3, 2, [])
        everyone = [*c.workers, new]
        assert all(w.membership()["live_size"] == 3 and w.membership()["answered_departed"] == [] for w in everyone)

        def step(rank, w):  # a tensor declared before the join, a new one, a broadcast to the joiner
            g = push_pull(w, "g", np.full(4, rank + 1.0, np.float32))
            h = push_pull(w, "h", np.full(2, 10.0 * (rank + 1), np.float32), op=1)
            b = push_pull(w, "b", np.full(3, 7.0 if rank == 0 else -1.0, np.float32), op=2, root=0)
            return g, h, b

        with ThreadPoolExecutor(3) as pool:
            out = list(pool.map(lambda w: step(w.rank, w), everyone))
        for g, h, b in out:
            assert np.array_equal(g, np.full(4, 6.0, np.float32)), out  # 1 + 2 + 3: it counts
            assert np.array_equal(h, np.full(2, 20.0, np.float32)) and np.array_equal(b, np.full(3, 7.0, np.float32))
        # The hung process of rank 2 wakes up and pushes a round of before the join: refused.
        zombie.send(PUSH, struct.pack("<I", 3), body=np.ones(4, np.float32).tobytes(),
                    key=0, version=1, arg=16, flags=2 << 8, sender=2)
        reply = zombie.recv(10)
        assert reply is not None and b"from before that rank rejoined" in reply[4], reply
        with ThreadPoolExecutor(3) as pool:  # and nothing of it was merged
            out = list(pool.map(lambda w: push_pull(w, "g", np.full(4, 1.0, np.float32)), everyone))
        assert all(np.array_equal(x, np.full(4, 3.0, np.float32)) for x in out), out
        fake.link.shutdown()
    finally:
        if new is not None:
            new.shutdown()
        c.close()


def test_a_hung_worker_declared_gone_during_an_admission_lets_the_joiner_in():
    # Ranks 0, 1 real, 2 and 3 fakes. Rank 2 dies; a new worker waits to join in its
    # place; 0 and 1 wait at an admission for rank 3, which hangs: its departure (the
    # scheduler's heartbeat check) completes the admission, and the join takes the old
    # rank 2 out of the scheduler's nodes while that check goes through them (a crash).
    fakes = []
    c = InProcessCluster(2, 1, extra_workers=2, fault_tolerance=True, peer_timeout=2,
                         before_ready=lambda c: fakes.extend([FakeWorker(c, 2), FakeWorker(c, 3)]))
    for fake in fakes:
        fake.welcome()
    stop = threading.Event()

    def heartbeats():  # rank 3 is alive until the admission waits for it
        while not stop.wait(0.25):
            fakes[1].send(HEARTBEAT)

    beat = threading.Thread(target=heartbeats, daemon=True)
    beat.start()
    new = None
    try:
        fakes[0].link.shutdown()
        deadline = time.monotonic() + 10
        while list(c.workers[0].membership()["departed"]) != [2]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        new = joiner(c, rank_hint=2)
        assert not new.wait_ready(0.5)
        handles = [w.enqueue_admission() for w in c.workers]
        stop.set()  # rank 3 hangs now
        beat.join()
        for w, h in zip(c.workers, handles):
            wait(w, h)
        assert new.wait_ready(10)
        assert all(list(w.membership()["joined"]) == [2] and w.membership()["live_size"] == 3 for w in c.workers)
        with ThreadPoolExecutor(3) as pool:
            out = list(pool.map(lambda w: push_pull(w, "h", np.full(2, w.rank + 1.0, np.float32)),
                                [*c.workers, new]))
        assert all(np.array_equal(x, np.full(2, 6.0, np.float32)) for x in out), out
        assert c.scheduler.stats()["nodes"] > 0  # the scheduler is alive
    finally:
        stop.set()
        for fake in fakes:
            fake.link.shutdown()
        if new is not None:
            new.shutdown()
        c.close()


def test_a_worker_cannot_join_a_job_that_has_all_its_workers():
    c = InProcessCluster(2, 1, fault_tolerance=True)
    with c:
        w = joiner(c)
        with pytest.raises(ConfigError, match="already has all 2 workers; a worker joins a running job only in the "
                                              "place of one that left"):
            while not w.wait_ready(0.1):
                pass
        w.shutdown()


def test_an_admission_needs_the_steps_finished_and_fault_tolerance():
    c = InProcessCluster(2, 1)
    with c:
        with pytest.raises(ConfigError, match="needs comm.fault_tolerance"):
            c.workers[0].enqueue_admission()
    c = InProcessCluster(2, 1, fault_tolerance=True)
    with c:
        x, out = np.ones(4, np.float32), np.empty(4, np.float32)
        h = c.workers[0].enqueue("x", "float32", [4], x, out, 0, 0, 0)  # rank 1 has not pushed yet
        with pytest.raises(ConfigError, match="an admission goes between steps: 1 operations"):
            c.workers[0].enqueue_admission()
        push_pull(c.workers[1], "x", x)
        wait(c.workers[0], h)
        assert np.array_equal(out, np.full(4, 2.0, np.float32))


@pytest.mark.parametrize("fault_tolerance", [False, True])
def test_a_worker_that_dies_during_rendezvous_is_forgotten_and_a_new_one_takes_its_rank(transport,
                                                                                       fault_tolerance):
    # Before the job exists nothing is lost: the scheduler forgets the dead registration
    # (with or without fault tolerance) and a replacement with the same rank completes it.
    from tests.engine.test_faults import HELLO, worker_hello

    sched = _core.Scheduler(2, 1, host="127.0.0.1", port=0, rendezvous_timeout=20, transport=transport,
                            fault_tolerance=fault_tolerance)
    sched.start()
    nodes = []
    try:
        early = _core.connect_raw(transport, "127.0.0.1", sched.port, handshake=True)
        early.send(HELLO, worker_hello(1))
        deadline = time.monotonic() + 10
        while sched.stats()["nodes"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        early.shutdown()  # dies before the others came
        while sched.stats()["nodes"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        nodes.append(_core.Server("127.0.0.1", sched.port, listen_host="127.0.0.1", numa="off",
                                  rendezvous_timeout=20, transport=transport))
        workers = [_core.Worker("127.0.0.1", sched.port, rank_hint=r, rendezvous_timeout=20, numa="off",
                                transport=transport, fault_tolerance=fault_tolerance) for r in range(2)]
        nodes += workers
        for n in nodes:
            n.start()
        for w in workers:
            while not w.wait_ready(0.1):
                pass
        with ThreadPoolExecutor(2) as pool:
            res = list(pool.map(lambda w: push_pull(w, "g", np.full(4, w.rank + 1.0, np.float32)), workers))
        assert all(np.array_equal(x, np.full(4, 3.0, np.float32)) for x in res)
        assert all(w.membership()["epoch"] == 0 for w in workers)  # nobody left the job
        for w in workers:
            w.shutdown()
        assert nodes[0].wait(5) and sched.wait(5)
    finally:
        for n in nodes:
            (n.stop if isinstance(n, _core.Server) else n.shutdown)()
        sched.stop()
