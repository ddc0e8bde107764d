"""The attacks of the security issue, each against a real job on loopback. Every one of
these succeeded against the v1 engine (a replayable secret token, an open data port,
a thread per connection that was never joined, per-receive timeouts only)."""

import hashlib
import hmac
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from bpstrain import _core
from bpstrain.bench import _protocol as wire
from bpstrain.bench import fuzz
from bpstrain.errors import ConfigError, PeerError
from tests.engine.harness import InProcessCluster, push_pull
from tests.engine.test_faults import FakeWorker

pytestmark = pytest.mark.timeout(120)

SECRET = "correct horse battery staple"


def threads_now():
    return len(os.listdir("/proc/self/task"))


def fds_now():
    return len(os.listdir("/proc/self/fd"))


def closed(sock, within):
    """True if the peer closes `sock` within `within` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_crypto_primitives_match_hashlib():
    for n in (0, 1, 55, 56, 63, 64, 65, 1000, 1 << 16):
        key, msg = os.urandom(n % 100), os.urandom(n)
        assert _core.hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()
    assert _core.pbkdf2_sha256(b"pw", b"salt", 777) == hashlib.pbkdf2_hmac("sha256", b"pw", b"salt", 777)


needs_libcrypto = pytest.mark.skipif(not _core.poly1305_available(), reason="no libcrypto.so.3 here")


@needs_libcrypto
def test_poly1305_matches_rfc_8439():
    key = bytes.fromhex("85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b")
    tag = _core.poly1305(key, b"Cryptographic Forum Research Group")
    assert tag.hex() == "a8061dc1305136c6c22b8baf0c0127a9"


def test_body_tags_use_the_fastest_authenticator_both_ends_have(monkeypatch):
    fakes = []
    with InProcessCluster(2, 1, extra_workers=1, before_ready=lambda c: fakes.append(FakeWorker(c, 2))) as c:
        fakes[0].welcome()
        want = "poly1305" if _core.poly1305_available() else "hmac-sha256"
        assert _core.link_body_auth(fakes[0].data_link()) == want
        monkeypatch.setenv("BPSTRAIN_NO_LIBCRYPTO", "1")
        assert _core.link_body_auth(fakes[0].data_link()) == "hmac-sha256"
        monkeypatch.delenv("BPSTRAIN_NO_LIBCRYPTO")
        # Untagged bodies need both ends to ask for them: this server does not.
        link = c.connect_raw(c.servers[0].port, handshake=True, key=fakes[0].keys[0], identity="worker 2",
                             body_tags=False)
        assert _core.link_body_auth(link) == want
        # The independent implementation (HMAC only) interoperates: a one-push round
        # comes back with a body whose tag it checks.
        conn = wire.Conn(c.servers[0].port)
        wire.handshake(conn, fakes[0].keys[0], "worker 2")
        conn.send(wire.PUSH, struct.pack("<I", 1), struct.pack("<4f", 1, 2, 3, 4), arg=16, flags=2 << 8,
                  sender=2, key=3, version=0)
        reply = conn.recv()
        assert reply[0] == 13 and struct.unpack("<4f", reply[3]) == (1, 2, 3, 4)  # kPullReply
        conn.close()
        res = c.run_all(lambda r, w: push_pull(w, "x", np.ones(8, np.float32), participants=2))
        assert all(np.all(x == 2) for x in res)
        fakes[0].send(wire.GOODBYE)


def test_bodies_go_untagged_only_when_both_ends_are_configured_so():
    sched = _core.Scheduler(1, 1, host="127.0.0.1", port=0, rendezvous_timeout=20)
    sched.start()
    server = _core.Server("127.0.0.1", sched.port, numa="off", authenticate_bodies=False)
    server.start()
    w = _core.Worker("127.0.0.1", sched.port, numa="off", rendezvous_timeout=20, authenticate_bodies=False)
    w.start()
    try:
        while not w.wait_ready(0.1):
            pass
        out = push_pull(w, "x", np.arange(1000, dtype=np.float32))
        assert np.array_equal(out, np.arange(1000, dtype=np.float32))
    finally:
        w.shutdown()
        server.stop()
        sched.stop()


def test_the_handshake_follows_its_specification_and_a_replay_is_refused():
    sched = _core.Scheduler(1, 1, host="127.0.0.1", port=0, rendezvous_timeout=30, secret=SECRET)
    sched.start()
    try:
        # An independent implementation (Python, hashlib) completes the handshake ...
        c = wire.Conn(sched.port)
        wire.handshake(c, wire.cluster_key(SECRET), "worker")
        captured = list(c.sent)
        c.close()
        # ... and what it sent, replayed by an observer, does not pass: the challenge is new.
        r = wire.Conn(sched.port)
        r.send_raw(captured[0])
        assert r.recv()[0] == wire.AUTH_CHALLENGE
        r.send_raw(captured[1])
        reply = r.recv()
        assert reply is not None and reply[0] == wire.ERROR and b"secret" in reply[2]
        r.close()
        assert sched.stats()["nodes"] == 0
    finally:
        sched.stop()


def test_a_replayed_or_forged_frame_after_the_handshake_drops_the_connection():
    sched = _core.Scheduler(2, 1, host="127.0.0.1", port=0, rendezvous_timeout=30, secret=SECRET)
    sched.start()
    try:
        c = wire.Conn(sched.port)
        wire.handshake(c, wire.cluster_key(SECRET), "worker")
        c.send(wire.HELLO, wire.worker_hello(0))
        deadline = time.monotonic() + 5
        while sched.stats()["nodes"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sched.stats()["nodes"] == 1  # an authenticated hello registers
        c.send_raw(c.sent[-1])  # the same authenticated frame again: its sequence number is old
        assert c.recv() is None
        deadline = time.monotonic() + 5
        while sched.stats()["nodes"] != 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sched.stats()["nodes"] == 0

        c = wire.Conn(sched.port)
        wire.handshake(c, wire.cluster_key(SECRET), "worker")
        h = wire.header(wire.HELLO, meta_len=len(wire.worker_hello(0)) + 32)
        c.send_raw(h + wire.worker_hello(0) + bytes(32))  # tags of zeros: forged
        assert c.recv() is None
    finally:
        sched.stop()


@pytest.mark.parametrize("secret", ["wrong", ""])
def test_a_stranger_cannot_register_as_the_server_before_the_real_one(secret):
    sched = _core.Scheduler(1, 1, host="127.0.0.1", port=0, rendezvous_timeout=30, secret=SECRET)
    sched.start()
    try:
        with pytest.raises(ConfigError, match="secret"):
            _core.connect_raw("tcp", "127.0.0.1", sched.port, handshake=True, secret=secret, identity="server")
        assert sched.stats()["nodes"] == 0
    finally:
        sched.stop()


def test_a_job_with_a_secret_sums_correctly_over_authenticated_links(transport):
    with InProcessCluster(3, 2, secret=SECRET, partition_bytes=4096) as c:
        res = c.run_all(lambda r, w: push_pull(w, "g", np.full(5000, r + 1.0, np.float32)))
    assert all(np.all(x == 6) for x in res)


def test_a_worker_refuses_a_scheduler_that_cannot_prove_the_key():
    # A fake scheduler: it answers the handshake without knowing the key.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def fake():
        conn, _ = listener.accept()
        with conn:
            hello = conn.recv(4096)
            assert hello
            meta = wire.s(os.urandom(32)) + struct.pack("<I", 1) + wire.s(os.urandom(32)) + struct.pack("<I", 0)
            conn.sendall(wire.frame(wire.AUTH_CHALLENGE, meta))
            conn.settimeout(5)
            assert conn.recv(4096) == b""  # the worker hung up without sending anything more

    t = threading.Thread(target=fake)
    t.start()
    w = _core.Worker("127.0.0.1", port, rendezvous_timeout=5, secret=SECRET, numa="off")
    w.start()
    with pytest.raises(ConfigError, match="could not prove"):
        while not w.wait_ready(0.1):
            pass
    w.shutdown()
    t.join(10)
    listener.close()


def test_a_server_refuses_pushes_without_the_workers_credential(transport):
    # No secret at all (the engine's default): the data port still refuses strangers,
    # and the workers' sums stay right.
    with InProcessCluster(2, 1) as c:
        port = c.servers[0].port
        for key in (b"", os.urandom(32)):
            if transport == "tcp":
                conn = wire.Conn(port)
                with pytest.raises(wire.Refused):
                    if key:
                        wire.handshake(conn, key, "worker 0", check_acceptor=False)
                    conn.send(wire.PUSH, b"", bytes(1024), arg=1024, flags=2 << 8, sender=0)
                    if conn.recv() is not None:
                        raise AssertionError("the server answered a forged push")
                    raise wire.Refused("closed")
                conn.close()
            with pytest.raises(ConfigError):
                c.connect_raw(port, handshake=True, key=key or os.urandom(32), identity="worker 0")
        res = c.run_all(lambda r, w: push_pull(w, "x", np.full(256, r + 1.0, np.float32)))
        assert all(np.all(x == 3) for x in res)


def test_a_worker_cannot_use_its_credential_to_speak_for_another_rank():
    fakes = []
    with InProcessCluster(2, 1, extra_workers=1, before_ready=lambda c: fakes.append(FakeWorker(c, 2))) as c:
        fakes[0].welcome()
        with pytest.raises(ConfigError):  # worker 2's credential, claiming to be worker 0
            c.connect_raw(c.servers[0].port, handshake=True, key=fakes[0].keys[0], identity="worker 0")
        link = fakes[0].data_link()  # its own identity passes, but a frame naming rank 0 does not
        link.send(wire.PUSH, b"", bytes(64), arg=64, flags=2 << 8, sender=0)
        assert link.recv(10) is None
        res = c.run_all(lambda r, w: push_pull(w, "x", np.ones(16, np.float32), participants=2))
        assert all(np.all(x == 2) for x in res)
        fakes[0].send(wire.GOODBYE)


def test_a_node_speaks_only_for_its_own_rank(capfd):
    fakes = []
    c = InProcessCluster(2, 1, extra_workers=1, before_ready=lambda c: fakes.append(FakeWorker(c, 2)))
    fakes[0].welcome()
    fakes[0].link.send(wire.HEARTBEAT, b"", sender=0)  # claims to be worker 0
    with pytest.raises(PeerError, match="claiming to come from rank 0"):
        c.run_all(lambda r, w: push_pull(w, "x", np.ones(4, np.float32)))
    with pytest.raises(PeerError):
        c.close()
    assert "claiming to come from rank 0" in capfd.readouterr().err


def test_only_workers_release_barriers():
    sched = _core.Scheduler(2, 1, host="127.0.0.1", port=0, rendezvous_timeout=20)
    sched.start()
    fake = wire.Conn(sched.port)  # registers as the job's server, then acts as a worker
    wire.handshake(fake, b"", "server")
    fake.send(wire.HELLO, wire.worker_hello(0, role=1))
    workers = [_core.Worker("127.0.0.1", sched.port, rank_hint=i, rendezvous_timeout=20, numa="off")
               for i in range(2)]
    for w in workers:
        w.start()
    try:
        assert fake.recv()[0] == wire.WELCOME
        fake.send(wire.BARRIER, sender=0)
        with pytest.raises(PeerError, match="only workers in the job take part in barriers"):
            sched.wait(10)
    finally:
        for w in workers:
            w.shutdown()
        fake.close()
        sched.stop()


class FakeJob:
    """A fake scheduler and server on loopback for one real worker: they issue the data
    credential themselves, so they pass the worker's handshake, and then say whatever
    the test wants (``on_declare(name) -> reply meta``)."""

    def __init__(self, workers=1, job_id=7, on_declare=None):
        self.sched_sock = socket.create_server(("127.0.0.1", 0))
        self.data_sock = socket.create_server(("127.0.0.1", 0))
        self.cred, self.workers, self.job_id, self.on_declare = os.urandom(32), workers, job_id, on_declare
        self.seen = {}
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._scheduler, self._server)]
        for t in self.threads:
            t.start()

    @property
    def port(self):
        return self.sched_sock.getsockname()[1]

    def _scheduler(self):
        conn = wire.Conn(sock=self.sched_sock.accept()[0])
        wire.accept_handshake(conn, b"")
        conn.recv()  # the worker's hello
        endpoint = f"127.0.0.1:{self.data_sock.getsockname()[1]}"
        conn.send(wire.WELCOME, wire.welcome(0, self.workers, [endpoint], self.job_id, [self.cred]))
        frame = conn.recv()
        if frame is not None and frame[0] == wire.DECLARE and self.on_declare:
            name = frame[2][4:4 + struct.unpack_from("<I", frame[2])[0]]
            conn.send(4, self.on_declare(name))  # kDeclareReply
            frame = conn.recv()
        self.seen["scheduler"] = frame
        conn.close()

    def _server(self):
        conn = wire.Conn(sock=self.data_sock.accept()[0])
        self.seen["identity"] = wire.accept_handshake(conn, self.cred)
        self.seen["data"] = conn.recv()
        conn.close()

    def worker(self, **kw):
        """A started worker of this job (no link probe: every auto setting is fixed)."""
        w = _core.Worker("127.0.0.1", self.port, rendezvous_timeout=10, numa="off", partition_bytes=4096,
                         credit_bytes=1 << 20, socket_send_buffer=0, **kw)
        w.start()
        return w

    def close(self):
        for t in self.threads:
            t.join(10)
        self.sched_sock.close()
        self.data_sock.close()


def test_a_forged_partition_table_is_refused_before_it_is_used():
    # The fake scheduler places a 64-byte tensor on a partition of 65,536 bytes: the v1
    # worker read 64 KiB past the tensor into its push and crashed.
    def forged(name):
        return wire.s(name) + struct.pack("<IqI", 0, 0, 1) + struct.pack("<qqI", 0, 1 << 16, 0)

    job = FakeJob(on_declare=forged)
    w = job.worker()
    while not w.wait_ready(0.1):
        pass
    with pytest.raises(PeerError, match="does not cover"):
        push_pull(w, "t", np.ones(16, np.float32))
    w.shutdown()
    job.close()
    assert job.seen["identity"] == "worker 0"
    assert job.seen["data"] is None  # not one byte of a push left the worker


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a segment owned by another user")
def test_a_shared_memory_segment_planted_by_another_user_is_refused():
    # The fake scheduler picks the job id, so the test knows the name of the local
    # group's first segment and plants it, owned by nobody, before the worker opens it.
    job_id = int.from_bytes(os.urandom(7), "little")
    planted = f"/dev/shm/bps{job_id:016x}h0bell"
    fd = os.open(planted, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 128)
    os.fchown(fd, 65534, 65534)
    os.close(fd)
    job = FakeJob(workers=2, job_id=job_id)
    w = job.worker(rank_hint=0, local_rank=0, local_size=2, hierarchical=1)
    try:
        with pytest.raises(Exception, match="belongs to uid 65534"):
            while not w.wait_ready(0.1):
                pass
    finally:
        w.shutdown()
        os.unlink(planted)
        job.close()


def test_a_connection_flood_leaves_no_threads_or_descriptors_behind():
    sched = _core.Scheduler(1, 1, host="127.0.0.1", port=0, rendezvous_timeout=60)
    sched.start()
    try:
        time.sleep(0.2)
        threads, fds = threads_now(), fds_now()
        for _ in range(3000):
            socket.create_connection(("127.0.0.1", sched.port), timeout=5).close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            socket.create_connection(("127.0.0.1", sched.port), timeout=5).close()  # reaps
            time.sleep(0.2)
            if sched.stats()["threads"] <= 2 and threads_now() <= threads + 2 and fds_now() <= fds + 2:
                break
        assert sched.stats()["threads"] <= 2
        assert threads_now() <= threads + 2 and fds_now() <= fds + 2
    finally:
        sched.stop()


def test_too_many_unfinished_handshakes_are_refused_at_the_door_and_the_job_still_forms():
    with InProcessCluster(2, 1) as c:
        idle = [socket.create_connection(("127.0.0.1", c.scheduler_port)) for _ in range(80)]
        try:
            refused = sum(closed(s, 2.0) for s in idle[64:])
            assert refused >= 10
            assert c.scheduler.stats()["refused"] >= 10
        finally:
            for s in idle:
                s.close()
        res = c.run_all(lambda r, w: push_pull(w, "x", np.ones(4, np.float32)))
        assert all(np.all(x == 2) for x in res)


def test_a_dripped_handshake_is_cut_at_its_deadline_and_stop_does_not_wait_for_it():
    sched = _core.Scheduler(1, 1, host="127.0.0.1", port=0, rendezvous_timeout=60)
    sched.start()
    sock = socket.create_connection(("127.0.0.1", sched.port))
    start = time.monotonic()
    hello = wire.frame(wire.AUTH_HELLO, wire.s(os.urandom(32)) + wire.s("worker") + struct.pack("<I", 0))
    cut = None
    try:
        for byte in hello * 4:
            sock.send(bytes([byte]))
            time.sleep(0.4)
            if time.monotonic() - start > 20:
                break
    except OSError:
        cut = time.monotonic() - start
    assert cut is not None and cut < 13  # the whole handshake has 10 s, however it trickles
    sock.close()
    # A drip in progress does not hold up stop().
    sock = socket.create_connection(("127.0.0.1", sched.port))
    sock.send(hello[:5])
    time.sleep(0.2)
    t0 = time.monotonic()
    sched.stop()
    assert time.monotonic() - t0 < 3
    sock.close()


def test_a_large_metadata_length_from_a_stranger_is_refused_before_it_is_read():
    sched = _core.Scheduler(1, 1, host="127.0.0.1", port=0, rendezvous_timeout=60)
    sched.start()
    try:
        sock = socket.create_connection(("127.0.0.1", sched.port))
        sock.sendall(wire.header(wire.AUTH_HELLO, meta_len=1 << 20))
        assert closed(sock, 2.0)  # dropped at the header: nothing waited for, nothing allocated
        sock.close()
    finally:
        sched.stop()


def test_unfinished_rounds_expire(transport):
    sched = _core.Scheduler(3, 1, host="127.0.0.1", port=0, rendezvous_timeout=30, transport=transport)
    sched.start()
    server = _core.Server("127.0.0.1", sched.port, numa="off", rendezvous_timeout=30, round_timeout=1.0,
                          transport=transport)
    server.start()
    fakes = []

    class Shim:  # what FakeWorker needs of a cluster
        def __init__(self):
            self.servers, self.secret, self.transport = [server], "", transport

        def connect_raw(self, port=None, handshake=False, **kw):
            return _core.connect_raw(transport, "127.0.0.1", port or sched.port, handshake=handshake, **kw)

    shim = Shim()
    for rank in range(3):
        fakes.append(FakeWorker(shim, rank))
    for f in fakes:
        f.welcome()
    link = fakes[0].data_link()
    link.send(wire.PUSH, b"", bytes(4096), arg=4096, flags=2 << 8, sender=0, key=5, version=1)
    deadline = time.monotonic() + 2
    while server.stats()["pending_rounds"] != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.stats()["pending_rounds"] == 1
    reply = link.recv(10)  # the round expires after 1 s: its pusher is told
    assert reply is not None and reply[0] == wire.ERROR and b"expired" in reply[4]
    assert server.stats()["pending_rounds"] == 0
    assert server.stats()["expired_rounds"] == 1
    for f in fakes:
        f.send(wire.GOODBYE)
    deadline = time.monotonic() + 10
    while not server.wait(0.1) and time.monotonic() < deadline:
        pass
    server.stop()
    sched.stop()


def test_a_server_listens_only_on_its_address_toward_the_scheduler():
    sched = _core.Scheduler(1, 1, host="127.0.0.1", port=0, rendezvous_timeout=5)
    server = _core.Server("127.0.0.1", sched.port, numa="off")
    try:
        assert server.endpoint.startswith("127.0.0.1:")
        assert _core.Server("127.0.0.1", sched.port, numa="off", listen_host="0.0.0.0").endpoint.startswith(":")
    finally:
        server.stop()
        sched.stop()


def test_a_partition_size_too_small_for_the_tensor_is_a_clear_error_and_the_job_goes_on():
    with InProcessCluster(2, 1, partition_bytes=4) as c:
        def job(rank, w):
            with pytest.raises(ConfigError, match="partition_bytes"):
                push_pull(w, "big", np.ones(1 << 18, np.float32))
            return push_pull(w, "small", np.ones(8, np.float32))
        assert all(np.all(x == 2) for x in c.run_all(job))


def test_the_fuzzer_finds_nothing_in_a_short_run():
    report = fuzz.run(fuzz.FuzzPlan(rounds=200, frames=300, floods=2000, drips=2, injections=20))
    assert report.ok, report.problems
    assert report.counts["connections"] == 2000 and report.counts["frames"] == 300
    assert all(code == 0 for code in report.exit_codes.values()), report.exit_codes
