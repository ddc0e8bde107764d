"""Malformed, truncated and oversized frames are dropped and logged; the rest goes on."""

import socket
import struct
import time

import numpy as np
import pytest

from tests.engine.harness import InProcessCluster, push_pull

pytestmark = pytest.mark.timeout(60)

MAGIC = 0x32535042  # "BPS2"
HEADER = struct.Struct("<IHHIiqQQQ")  # magic type flags meta_len sender arg key version body_len


def header(type_, body_len=0, meta_len=0, flags=0, arg=0, key=0):
    return HEADER.pack(MAGIC, type_, flags, meta_len, 0, arg, key, 0, body_len)


def send_and_close(port, payload, linger=0.05):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        time.sleep(linger)


def meta_str(s):
    b = s.encode()
    return struct.pack("<I", len(b)) + b


GARBAGE = [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",            # wrong protocol entirely
    header(1)[:20],                                   # truncated header
    header(1, body_len=1 << 40),                      # oversized body
    header(1, meta_len=1 << 30),                      # oversized metadata
    header(999),                                      # unknown frame type
    header(1, meta_len=3) + b"\x01\x00\x00",          # truncated metadata
]


def test_scheduler_survives_garbage(capfd):
    with InProcessCluster(2, 1) as c:
        port = c.scheduler_port
        for payload in GARBAGE:
            send_and_close(port, payload)
        res = c.run_all(lambda r, w: push_pull(w, "x", np.ones(10, np.float32)))
        assert all(np.all(x == 2) for x in res)
    assert "malformed frame" in capfd.readouterr().err


def test_server_survives_garbage(capfd):
    with InProcessCluster(2, 1) as c:
        port = c.servers[0].port
        # v1's data hello (type 14) and frames after it: refused at the handshake now.
        hello = struct.pack("<q", 7) + meta_str("")
        server_hello = header(14, meta_len=len(hello)) + hello
        for payload in GARBAGE + [
            server_hello + header(12, body_len=1 << 40, arg=1 << 40),        # oversized push
            server_hello + header(12, body_len=8, arg=16, flags=2 << 8),     # inconsistent lengths
            server_hello + header(12, body_len=8, arg=8, flags=77 << 8),     # unknown dtype
            server_hello + header(3),                                        # control frame on data port
        ]:
            send_and_close(port, payload)
        res = c.run_all(lambda r, w: push_pull(w, "x", np.ones(10, np.float32)))
        assert all(np.all(x == 2) for x in res)
    err = capfd.readouterr().err
    assert "malformed frame" in err
