"""comm.fault_tolerance when a server dies: its partitions move to the other servers
(the scheduler's ServerLostLocked), the workers push again what it had not answered
and hand the answers they kept to the new servers (worker_replacement.cc,
answer_archive.h), so the results equal a run without the loss. A worker the lost
server had not answered, while the others had, is played by a FakeWorker, so that case
is deterministic."""

import struct
import time

import numpy as np
import pytest

from bpstrain.errors import PeerError
from tests.engine.harness import InProcessCluster, push_pull, wait
from tests.engine.test_faults import DECLARE, PUSH, FakeWorker, MetaReader

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("transport")]
DECLARE_REPLY, PULL_REPLY, SERVER_LOST = 4, 13, 24
FLOAT32 = 2


def wait_for(predicate, timeout=10, what=""):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def close_after_loss(c, lost):
    """Tears the cluster down; the lost server was stopped already."""
    for w in c.workers:
        w.shutdown()
    for j, s in enumerate(c.servers):
        if j not in lost:
            assert s.wait(5)  # terminated, not failed
        s.stop()
    assert c.scheduler.wait(5)
    c.scheduler.stop()


def test_the_rounds_a_lost_server_held_are_pushed_again_and_every_result_is_exact():
    # Small partitions: one tensor spreads over the three servers.
    c = InProcessCluster(3, 3, fault_tolerance=True, partition_bytes=256)
    data = [np.arange(4096, dtype=np.float32) * (r + 1) for r in range(3)]
    outs = [np.empty_like(d) for d in data]
    c.run_all(lambda r, w: push_pull(w, "g", data[r] * 0))
    # Two workers push and wait; the third has not pushed yet: every server holds rounds.
    handles = [c.workers[r].enqueue("g", "float32", [4096], data[r], outs[r], 0, 0, 0) for r in range(2)]
    servers_of_g = {p[2] for p in c.workers[0].partitions("g")}
    assert servers_of_g == {0, 1, 2}
    wait_for(lambda: all(s.stats()["pending_rounds"] > 0 for s in c.servers), what="rounds on every server")
    c.servers[1].stop()  # dies with its rounds
    # A worker lists the server as lost at once, and moves its partitions once its links
    # to it have closed.
    wait_for(lambda: all(w.membership()["lost_servers"] == [1] and {p[2] for p in w.partitions("g")} == {0, 2}
                         for w in c.workers), what="the loss noticed and the partitions moved")
    handles.append(c.workers[2].enqueue("g", "float32", [4096], data[2], outs[2], 0, 0, 0))
    for w, h in zip(c.workers, handles):
        wait(w, h)
    assert all(np.array_equal(o, sum(data)) for o in outs)
    # The job goes on over two servers: sums, averages, broadcasts and new tensors.
    for step in range(3):
        res = c.run_all(lambda r, w: push_pull(w, "g", data[r] + step, op=1))
        assert all(np.array_equal(x, sum(data) / 3 + step) for x in res)
    res = c.run_all(lambda r, w: push_pull(w, "new", np.full(300, r + 1.0, np.float32)))
    assert all(np.array_equal(x, np.full(300, 6.0, np.float32)) for x in res)
    assert {p[2] for p in c.workers[0].partitions("new")} <= {0, 2}
    res = c.run_all(lambda r, w: push_pull(w, "b", np.full(64, r + 1.0, np.float32), op=2, root=2))
    assert all(np.array_equal(x, np.full(64, 3.0, np.float32)) for x in res)
    assert all(w.membership()["live_size"] == 3 for w in c.workers)  # no worker left
    close_after_loss(c, {1})


def declare_meta(name, shape, partition_bytes):
    """A worker's kDeclare (tensor_registry.cc): float32 on the CPU, the whole job (participants 0)."""
    def s(x):
        return struct.pack("<I", len(x)) + x.encode()
    return (s(name) + struct.pack("<I", FLOAT32) + struct.pack("<I", len(shape))
            + b"".join(struct.pack("<q", d) for d in shape) + struct.pack("<qIq", partition_bytes, 0, 0)
            + s("cpu") + s(""))


def next_frame(link, type_, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frame = link.recv(1)
        if frame is not None and frame[0] == type_:
            return frame
    raise AssertionError(f"no frame of type {type_}")


def push_frame(link, key, version, values, sender):
    body = np.asarray(values, np.float32).tobytes()
    link.send(PUSH, struct.pack("<III", 3, 0xFFFFFFFF, 3), body=body, key=key, version=version,
              arg=len(body), flags=FLOAT32 << 8, sender=sender)


def test_a_worker_the_lost_server_had_not_answered_gets_the_answer_the_others_kept():
    fakes = []
    c = InProcessCluster(2, 2, extra_workers=1, fault_tolerance=True, partition_bytes=1 << 20,
                         before_ready=lambda c: fakes.append(FakeWorker(c, 2)))
    fake = fakes[0]
    fake.welcome()
    data = [np.full(4, r + 1.0, np.float32) for r in range(3)]
    outs = [np.empty(4, np.float32) for _ in range(2)]
    handles = [c.workers[r].enqueue("g", "float32", [4], data[r], outs[r], 0, 0, 0) for r in range(2)]
    fake.send(DECLARE, declare_meta("g", [4], 1 << 20))
    reply = MetaReader(next_frame(fake.link, DECLARE_REPLY)[4])
    assert reply.str() == b"g" and reply.take("<I") == 0
    tensor, nparts = reply.take("<q"), reply.take("<I")
    _offset, _len, server = reply.take("<q"), reply.take("<q"), reply.take("<I")
    assert nparts == 1
    key = tensor << 20
    data_link = fake.data_link(server)
    push_frame(data_link, key, 0, data[2], 2)
    for w, h in zip(c.workers, handles):
        wait(w, h)
    assert all(np.array_equal(o, np.full(4, 6.0, np.float32)) for o in outs)
    # The server answered the two real workers; worker 2 never reads its answer, and the
    # server dies: as if it was killed before it sent that one.
    c.servers[server].stop()
    data_link.shutdown()
    notice = MetaReader(next_frame(fake.link, SERVER_LOST)[4])
    assert notice.take("<I") == server and notice.take("<I") == 1
    assert notice.take("<q") == tensor and notice.take("<I") == 0
    new_server = notice.take("<I")
    assert new_server == 1 - server
    # Worker 2 pushes the round again to the new server: it gets the answer the real
    # workers kept and handed over (its push is not summed a second time).
    data_link = fake.data_link(new_server)
    push_frame(data_link, key, 0, data[2], 2)
    answer = data_link.recv(10)
    assert answer is not None and answer[0] == PULL_REPLY and answer[3] == 3, answer
    assert np.array_equal(np.frombuffer(answer[5], np.float32), np.full(4, 6.0, np.float32))
    # The next round over the new server counts all three again.
    tens = [d * 10 for d in data]  # alive until the ops complete
    handles = [c.workers[r].enqueue("g", "float32", [4], tens[r], outs[r], 0, 0, 0) for r in range(2)]
    push_frame(data_link, key, 1, tens[2], 2)
    for w, h in zip(c.workers, handles):
        wait(w, h)
    assert all(np.array_equal(o, np.full(4, 60.0, np.float32)) for o in outs)
    answer = data_link.recv(10)
    assert answer is not None and np.array_equal(np.frombuffer(answer[5], np.float32), np.full(4, 60.0, np.float32))
    # Nothing is kept for round 0 any more.
    wait_for(lambda: c.servers[new_server].stats()["pending_rounds"] == 0, what="the handed-over answer forgotten")
    data_link.shutdown()
    fake.link.shutdown()  # leaves (fault tolerance): the job can end
    close_after_loss(c, {server})


def test_the_last_server_or_a_job_without_fault_tolerance_still_fails_when_a_server_dies():
    for servers, ft in [(1, True), (2, False)]:
        c = InProcessCluster(2, servers, fault_tolerance=ft)
        c.run_all(lambda r, w: push_pull(w, "x", np.ones(8, np.float32)))
        c.servers[0].stop()

        def job(rank, w):
            with pytest.raises(PeerError, match="server 0"):
                push_pull(w, "y", np.ones(8, np.float32))
            return True

        assert all(c.run_all(job))
        for w in c.workers:
            w.shutdown()
        for s in c.servers:
            s.stop()
        with pytest.raises(PeerError, match="no other server is left" if ft else "cannot continue"):
            c.scheduler.wait(5)
        c.scheduler.stop()
