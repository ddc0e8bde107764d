"""bpstrain's wire protocol written a second time, in Python, for the fuzzer and the
security tests: frames, the challenge-response handshake and the per-frame tags
(``core_ext/src/secure_link.h`` is the specification). An independent implementation
lets a test play a peer that follows the protocol exactly up to the point where it
cheats (replays a proof, forges a tag, claims another rank).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

MAGIC = 0x32535042  # "BPS2"
HEADER = struct.Struct("<IHHIiqQQQ")  # magic type flags meta_len sender arg key version body_len
HELLO, WELCOME, DECLARE, BARRIER, HEARTBEAT, GOODBYE, ERROR, PUSH = 1, 2, 3, 5, 7, 8, 11, 12
AUTH_HELLO, AUTH_CHALLENGE, AUTH_PROOF, AUTH_OK = 17, 18, 19, 20
TAG = 16
KEY_SALT, KEY_ITERATIONS = b"bpstrain cluster key v2", 100000


def header(type_: int, meta_len: int = 0, body_len: int = 0, flags: int = 0, sender: int = -1,
           arg: int = 0, key: int = 0, version: int = 0) -> bytes:
    return HEADER.pack(MAGIC, type_, flags, meta_len, sender, arg, key, version, body_len)


def frame(type_: int, meta: bytes = b"", body: bytes = b"", **fields) -> bytes:
    return header(type_, len(meta), len(body), **fields) + meta + body


def s(value: bytes | str) -> bytes:
    """A length-prefixed string, as MetaWriter::Str writes it."""
    b = value.encode() if isinstance(value, str) else value
    return struct.pack("<I", len(b)) + b


def cluster_key(secret: str) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret.encode(), KEY_SALT, KEY_ITERATIONS) if secret else b""


HMAC_SHA256, POLY1305, NO_BODY_TAGS = 0, 1, 2  # body authenticators (body_mac.h)


def _mac(key: bytes, label: str, nc: bytes, ns: bytes, identity: bytes, offer: int = 0,
         choice: int = HMAC_SHA256) -> bytes:
    transcript = s(label) + s(nc) + s(ns) + s(identity) + struct.pack("<II", offer, choice)
    return hmac.new(key, transcript, hashlib.sha256).digest()


class Conn:
    """A TCP connection that speaks frames; after a handshake it tags every frame."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", timeout: float = 10.0, sock=None):
        self.sock = sock if sock is not None else socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(timeout)
        self.sent: list[bytes] = []  # every frame sent, as bytes: what an observer captures
        self.send_key = self.recv_key = None
        self.send_seq = self.recv_seq = 0

    def close(self) -> None:
        self.sock.close()

    def send_raw(self, data: bytes) -> None:
        self.sent.append(data)
        self.sock.sendall(data)

    def send(self, type_: int, meta: bytes = b"", body: bytes = b"", **fields) -> None:
        if self.send_key is None:
            return self.send_raw(frame(type_, meta, body, **fields))
        seq = struct.pack("<Q", self.send_seq)
        self.send_seq += 1
        h = header(type_, len(meta) + 2 * TAG, len(body), **fields)
        tag_h = hmac.new(self.send_key, seq + h + meta, hashlib.sha256).digest()[:TAG]
        tag_b = hmac.new(self.send_key, seq + body, hashlib.sha256).digest()[:TAG] if body else bytes(TAG)
        self.send_raw(h + meta + tag_h + tag_b + body)

    def _exact(self, n: int) -> bytes | None:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                return None
            out += chunk
        return out

    def recv(self):
        """(type, fields dict, meta, body) of the next frame (tags checked), or None at EOF."""
        try:
            raw = self._exact(HEADER.size)
        except ConnectionResetError:
            return None  # closed on us, as good as a clean end here
        if raw is None:
            return None
        magic, type_, flags, meta_len, sender, arg, key, version, body_len = HEADER.unpack(raw)
        meta = self._exact(meta_len) or b""
        body = self._exact(body_len) if body_len else b""
        if self.recv_key is not None:
            seq = struct.pack("<Q", self.recv_seq)
            self.recv_seq += 1
            payload, tag_h, tag_b = meta[:-2 * TAG], meta[-2 * TAG:-TAG], meta[-TAG:]
            want = hmac.new(self.recv_key, seq + raw + payload, hashlib.sha256).digest()[:TAG]
            if not hmac.compare_digest(want, tag_h):
                raise ValueError("a frame from the engine failed authentication")
            if body and not hmac.compare_digest(
                    tag_b, hmac.new(self.recv_key, seq + body, hashlib.sha256).digest()[:TAG]):
                raise ValueError("a frame body from the engine failed authentication")
            meta = payload
        fields = dict(flags=flags, sender=sender, arg=arg, key=key, version=version)
        return type_, fields, meta, body


class Refused(Exception):
    """The acceptor refused the handshake (its reason is the message)."""


def handshake(conn: Conn, key: bytes, identity: str = "worker", check_acceptor: bool = True) -> None:
    """The connecting side of the handshake; then ``conn`` tags every frame.

    Raises:
        Refused: the acceptor sent an error or closed the connection.
        ValueError: the acceptor could not prove ``key``.
    """
    ident = identity.encode()
    nc = os.urandom(32)
    offer = 0  # this implementation tags bodies with HMAC-SHA256 only
    conn.send(AUTH_HELLO, s(nc) + s(ident) + struct.pack("<II", 1 if key else 0, offer))
    reply = conn.recv()
    if reply is None or reply[0] == ERROR:
        raise Refused(_reason(reply))
    meta = reply[2]
    n = struct.unpack_from("<I", meta)[0]
    ns = meta[4:4 + n]
    proof_len = struct.unpack_from("<I", meta, 8 + n)[0]
    proof = meta[12 + n:12 + n + proof_len]
    choice = struct.unpack_from("<I", meta, 12 + n + proof_len)[0]
    if not key:
        return
    if choice != HMAC_SHA256:
        raise ValueError(f"the acceptor chose body authenticator {choice}, which was not offered")
    if check_acceptor and not hmac.compare_digest(proof, _mac(key, "acceptor", nc, ns, ident, offer, choice)):
        raise ValueError("the acceptor could not prove the key")
    conn.send(AUTH_PROOF, s(_mac(key, "connector", nc, ns, ident, offer, choice)))
    ok = conn.recv()
    if ok is None or ok[0] != AUTH_OK:
        raise Refused(_reason(ok))
    conn.send_key = _mac(key, "connector->acceptor", nc, ns, ident, offer, choice)
    conn.recv_key = _mac(key, "acceptor->connector", nc, ns, ident, offer, choice)


def accept_handshake(conn: Conn, key: bytes) -> str:
    """The acceptor side of the handshake (a fake scheduler or server); returns the peer's
    identity. With ``key`` b"" the link stays unauthenticated, as the engine's is."""
    hello = conn.recv()
    if hello is None or hello[0] != AUTH_HELLO:
        raise Refused(_reason(hello))
    meta = hello[2]
    n = struct.unpack_from("<I", meta)[0]
    nc = meta[4:4 + n]
    m = struct.unpack_from("<I", meta, 4 + n)[0]
    ident = meta[8 + n:8 + n + m]
    offer = struct.unpack_from("<I", meta, 12 + n + m)[0]
    ns = os.urandom(32)
    choice = HMAC_SHA256  # whatever the peer offered, this implementation has only HMAC

    def mac(label):
        return _mac(key, label, nc, ns, ident, offer, choice)
    conn.send(AUTH_CHALLENGE, s(ns) + struct.pack("<I", 1 if key else 0) + s(mac("acceptor") if key else b"")
              + struct.pack("<I", choice))
    if key:
        proof = conn.recv()
        if proof is None or not hmac.compare_digest(proof[2][4:], mac("connector")):
            raise Refused("the connecting side could not prove the key")
        conn.send(AUTH_OK, s(mac("accepted")))
        conn.send_key = mac("acceptor->connector")
        conn.recv_key = mac("connector->acceptor")
    return ident.decode()


def welcome(rank: int, workers: int, servers: list[str], job_id: int, keys: list[bytes]) -> bytes:
    """A scheduler's welcome: rank, sizes, server endpoints, job id, data credentials."""
    meta = struct.pack("<qII", rank, workers, len(servers)) + b"".join(s(e) for e in servers)
    return meta + struct.pack("<qI", job_id, len(keys)) + b"".join(s(k) for k in keys)


def _reason(reply) -> str:
    if reply is None:
        return "closed the connection"
    meta = reply[2]
    if reply[0] == ERROR and len(meta) >= 4:
        return meta[4:4 + struct.unpack_from("<I", meta)[0]].decode(errors="replace")
    return f"frame type {reply[0]}"


def worker_hello(rank: int = -1, role: int = 2) -> bytes:
    """The registration hello: role, rank hint, listen endpoint, advertise host, pid,
    hostname, local size, host id."""
    endpoint = "127.0.0.1:9" if role == 1 else ""
    return (struct.pack("<Iq", role, rank) + s(endpoint) + s("") + struct.pack("<q", os.getpid())
            + s("fuzzer") + struct.pack("<I", 1) + s(""))
