"""Deterministic fault injection: the test plays a broken or hostile peer through a raw
frame link (``_core.connect_raw``), over TCP and over the in-process transport."""

import struct
import threading
import time

import numpy as np
import pytest

from bpstrain import _core
from bpstrain.bench import _protocol as protocol
from bpstrain.errors import BpsTimeoutError, PeerError
from tests.engine.harness import InProcessCluster, push_pull

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("transport")]

HELLO, WELCOME, DECLARE, HEARTBEAT, PEER_DEAD, PUSH = 1, 2, 3, 7, 10, 12


def s(text):
    b = text.encode()
    return struct.pack("<I", len(b)) + b


def worker_hello(rank):
    # role, rank hint, listen endpoint, advertise host, pid, hostname, local size, host id
    return (struct.pack("<Iq", 2, rank) + s("") + s("") + struct.pack("<q", 4242) + s("fake")
            + struct.pack("<I", 1) + s(""))


class MetaReader:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt):
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def str(self):
        n = self.take("<I")
        self.pos += n
        return self.data[self.pos - n:self.pos]


def parse_welcome(meta):
    """(rank, server endpoints, data credentials by server) from a worker's welcome."""
    r = MetaReader(meta)
    rank, _workers, servers = r.take("<q"), r.take("<I"), r.take("<I")
    endpoints = [r.str().decode() for _ in range(servers)]
    r.take("<q")  # job id
    keys = [r.str() for _ in range(r.take("<I"))]
    return rank, endpoints, keys


class FakeWorker:
    """Joins the job as its last worker (through the real handshake), then does only
    what the test says: a registered worker that misbehaves."""

    def __init__(self, cluster, rank):
        self.cluster, self.rank = cluster, rank
        self.link = cluster.connect_raw(handshake=True)
        self.link.send(HELLO, worker_hello(rank))

    def welcome(self):
        frame = self.link.recv(10)
        assert frame is not None and frame[0] == WELCOME, frame
        self.rank, self.endpoints, self.keys = parse_welcome(frame[4])
        return frame

    def send(self, type_, meta=b"", **kw):
        self.link.send(type_, meta, sender=self.rank, **kw)

    def data_link(self, server=0):
        """A data connection to `server`, authenticated with this worker's credential."""
        return self.cluster.connect_raw(self.cluster.servers[server].port, handshake=True,
                                        key=self.keys[server], identity=f"worker {self.rank}")


def run_until_failure(cluster):
    """Every real worker's next op fails with PeerError; returns the messages."""
    def job(rank, w):
        with pytest.raises(PeerError) as info:
            push_pull(w, "x", np.ones(4, np.float32))
        return str(info.value)

    return cluster.run_all(job)


def close_failed(cluster):
    with pytest.raises(PeerError):
        cluster.close()


def test_a_worker_that_dies_fails_the_others_with_its_name():
    fakes = []
    c = InProcessCluster(2, 1, extra_workers=1, before_ready=lambda c: fakes.append(FakeWorker(c, 2)))
    fakes[0].welcome()
    fakes[0].link.shutdown()
    messages = run_until_failure(c)
    assert all("worker 2" in m and "fake" in m for m in messages), messages
    close_failed(c)


def test_a_worker_that_hangs_is_declared_dead_after_the_peer_timeout():
    fakes = []
    t0 = time.monotonic()
    c = InProcessCluster(2, 1, extra_workers=1, peer_timeout=3,
                         before_ready=lambda c: fakes.append(FakeWorker(c, 2)))
    fakes[0].welcome()  # then silence: no heartbeats, no ops
    messages = run_until_failure(c)
    assert all("no heartbeat" in m and "worker 2" in m for m in messages), messages
    assert time.monotonic() - t0 < 15
    close_failed(c)



def test_nodes_that_waited_longer_than_the_peer_timeout_for_the_last_worker_are_not_silent():
    # Heartbeats start with the welcome. The server and two workers register, then the
    # last worker takes longer than the peer timeout to arrive (as workers importing
    # their framework on a loaded machine): the early nodes were waiting, not silent.
    fakes = []

    def late_worker(c):
        time.sleep(2.5)
        fakes.append(FakeWorker(c, 2))

    c = InProcessCluster(2, 1, extra_workers=1, peer_timeout=2, before_ready=late_worker)
    fakes[0].welcome()
    stop = threading.Event()

    def heartbeats():  # the late worker is alive
        while not stop.wait(0.25):
            fakes[0].send(HEARTBEAT)

    beat = threading.Thread(target=heartbeats, daemon=True)
    beat.start()
    try:
        # More than a peer timeout after the welcome: no PEER_DEAD notice for anyone.
        with pytest.raises(BpsTimeoutError):
            fakes[0].link.recv(3.0)
        res = c.run_all(lambda r, w: w.membership()["epoch"])
        assert res == [0, 0]
    finally:
        stop.set()
        beat.join()
        fakes[0].link.shutdown()
    close_failed(c)

def test_a_receive_that_times_out_leaves_the_link_up(transport):
    # A node waits for its welcome in 0.2 s slices: a slice that ends empty must not close
    # its link (over UCX it once did, so nodes reconnected every 0.2 s until the last one
    # came, and the churn of connection requests crashed UCX in a server on a loaded host).
    sched = _core.Scheduler(2, 1, host="127.0.0.1", port=0, rendezvous_timeout=20, transport=transport)
    sched.start()
    early = _core.connect_raw(transport, "127.0.0.1", sched.port, handshake=True)
    try:
        early.send(HELLO, worker_hello(0))
        for _ in range(3):
            with pytest.raises(BpsTimeoutError):
                early.recv(0.2)
        assert sched.stats()["nodes"] == 1  # still registered: the link never dropped
        late = [_core.connect_raw(transport, "127.0.0.1", sched.port, handshake=True, identity=who)
                for who in ("worker", "server")]
        late[0].send(HELLO, worker_hello(1))
        late[1].send(HELLO, protocol.worker_hello(0, role=1))
        frame = early.recv(10)
        assert frame is not None and frame[0] == WELCOME, frame
        assert MetaReader(frame[4]).take("<q") == 0
        for link in late:
            link.shutdown()
    finally:
        early.shutdown()
        sched.stop()


@pytest.mark.parametrize("meta", [b"\x01", s("x") + b"\x02\x00", s("x") + struct.pack("<I", 99)])
def test_a_worker_that_sends_a_malformed_declare_is_dropped_and_named(meta, capfd):
    fakes = []
    c = InProcessCluster(2, 1, extra_workers=1, before_ready=lambda c: fakes.append(FakeWorker(c, 2)))
    fakes[0].welcome()
    fakes[0].send(DECLARE, meta)
    messages = run_until_failure(c)
    assert all("malformed frame" in m for m in messages), messages
    close_failed(c)
    assert "malformed frame" in capfd.readouterr().err


@pytest.mark.parametrize("frame", [
    dict(type=PUSH, arg=1 << 40),                              # length beyond any partition
    dict(type=PUSH, arg=16, body=b"\0" * 8, flags=2 << 8),     # body shorter than its length
    dict(type=PUSH, arg=8, body=b"\0" * 8, flags=77 << 8),     # unknown dtype
    dict(type=PUSH, arg=8, body=b"\0" * 8, flags=2 << 8, meta=struct.pack("<I", 99)),  # 99 contributions
    # a lost server's answer (kRecoveredAnswer) handed over in a job without fault tolerance
    dict(type=PUSH, arg=8, body=b"\0" * 8, flags=2 << 8,
         meta=struct.pack("<IIIIqII", 3, 0xFFFFFFFF, 3, 6, 3, 0, 0)),
    dict(type=PUSH, arg=8, body=b"\0" * 8, flags=2 << 8 | 4),  # keeps its own result, but a sum
    dict(type=DECLARE),                                        # control frame on a data link
    dict(type=999),                                            # unknown type
])
def test_a_server_drops_a_garbage_data_link_and_the_job_goes_on(frame, capfd):
    # A registered worker (it holds a real credential) sends garbage on a second data
    # connection: the server drops that connection, sums nothing wrong, and goes on.
    fakes = []
    with InProcessCluster(2, 1, extra_workers=1, before_ready=lambda c: fakes.append(FakeWorker(c, 2))) as c:
        fakes[0].welcome()
        link = fakes[0].data_link()
        frame = dict(frame)
        link.send(frame.pop("type"), sender=2, **frame)
        assert link.recv(10) is None  # the server closed it
        res = c.run_all(lambda r, w: push_pull(w, "x", np.ones(10, np.float32), participants=2))
        assert all(np.all(x == 2) for x in res)
        fakes[0].send(8)  # goodbye: the fake worker leaves cleanly
    assert "malformed frame" in capfd.readouterr().err


def test_the_engine_runs_a_job_over_either_transport(transport):
    t0 = time.monotonic()
    with InProcessCluster(4, 2, partition_bytes=4096) as c:
        res = c.run_all(lambda r, w: push_pull(w, "g", np.full(10000, r + 1.0, np.float32)))
    assert all(np.all(x == 10) for x in res)
    # A four-worker job, start to end, in well under a second on either transport.
    assert time.monotonic() - t0 < 10
