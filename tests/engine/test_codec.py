"""Compressed push_pull on the servers: the C++ codec equals bpstrain/_codec.py's numpy
reference byte for byte (decode in rank order, fp32 sum, server error feedback,
re-encode), through real servers too, and malformed or disagreeing blobs are refused."""

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bpstrain import _codec as codec
from bpstrain._core import CompressedRounds, Op
from bpstrain.errors import BpsError, ConfigError, MismatchError
from tests.engine.harness import InProcessCluster, wait

pytestmark = pytest.mark.timeout(60)

CASES = [
    ("onebit", dict(codec=codec.ONEBIT)),
    ("onebit-unscaled", dict(codec=codec.ONEBIT, scaled=False)),
    ("onebit-no-server-ef", dict(codec=codec.ONEBIT, server_ef=False)),
    ("topk", dict(codec=codec.TOPK, ratio=0.05)),
    ("dithering", dict(codec=codec.DITHERING, levels=7)),
]
SIZES = (1000, 1000, 333, 1, 9)  # chunks of one tensor: full, short, one element


def _tensor_blobs(rng, spec, sizes=SIZES, stochastic=False):
    """One worker's compressed tensor: a blob per chunk, values spanning magnitudes."""
    spec = dict(spec)
    c = spec.pop("codec")
    ratio = spec.pop("ratio", None)
    out = []
    for n in sizes:
        x = (rng.standard_normal(n) * 10 ** rng.uniform(-3, 3)).astype(np.float32)
        if c == codec.TOPK:
            spec["k"] = codec.topk_count(n, ratio)
        u = rng.random(n) if stochastic and c == codec.DITHERING else None
        out.append(codec.encode(c, x, u=u, **spec))
    return b"".join(out)


@pytest.mark.parametrize("name,spec", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("workers", [2, 3])
def test_the_server_rule_equals_the_numpy_reference(name, spec, workers):
    rng = np.random.default_rng(workers)
    server, residuals = CompressedRounds(), {}
    for step in range(4):  # the residual carries from round to round
        pushes = [_tensor_blobs(rng, spec, stochastic=True) for _ in range(workers)]
        assert server.round(5, step, pushes) == codec.server_round(pushes, residuals)


def test_error_feedback_keeps_what_the_answer_dropped():
    # Top-1 on the server: what one round's answer leaves out comes back in later rounds.
    server = CompressedRounds()

    def round_(version, *tensors):
        pushes = [codec.encode(codec.TOPK, np.float32(t), k=1) for t in tensors]
        return codec.decode_all(server.round(1, version, pushes))

    np.testing.assert_array_equal(round_(0, [3, 0, 0], [0, 2, 0]), [3, 0, 0])  # keeps [0, 2, 0]
    np.testing.assert_array_equal(round_(1, [0, 0, 1], [0, 0, 1]), [0, 2, 0])  # tie: lower index
    np.testing.assert_array_equal(round_(2, [0, 0, 0], [0, 0, 0]), [0, 0, 2])  # the rest


def _large_topk_inputs():
    """Chunks big enough for the codec's sampled threshold, and the patterns that could
    fool it: ties, zeros, NaN, and values the strided sample never sees."""
    n = 1 << 17
    rng = np.random.default_rng(11)
    gauss = rng.standard_normal(n).astype(np.float32)
    ties = np.repeat(rng.standard_normal(n // 64), 64).astype(np.float32)
    sparse = np.zeros(n, np.float32)
    sparse[rng.choice(n, 500, replace=False)] = rng.standard_normal(500)
    with_nan = gauss.copy()
    with_nan[::7] = np.nan
    sampled = (np.arange(4096) * (n / 4096)).astype(np.int64)
    hidden = gauss * 1e-3
    hidden[sampled + 1] = 10 + rng.random(4096)  # the sample sees only the small values
    decoy = gauss * 1e-3
    decoy[sampled] = 10  # the sample sees only these: fewer than k pass its threshold
    return {"gaussian": gauss, "ties": ties, "mostly zeros": sparse, "NaN": with_nan,
            "hidden from the sample": hidden, "decoy": decoy}


@pytest.mark.parametrize("pattern", list(_large_topk_inputs()))
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1, 0.2])
def test_the_host_top_k_encoder_equals_the_reference_on_large_chunks(pattern, ratio):
    from bpstrain._core import codec_encode

    x = _large_topk_inputs()[pattern]
    out = np.empty(codec.compressed_bytes(codec.TOPK, x.size, x.size, ratio), np.uint8)
    codec_encode(x, out, None, codec.TOPK, codec.FLAG_SERVER_EF, 0, x.size, ratio, 0)
    assert out.tobytes() == codec.encode(codec.TOPK, x, k=codec.topk_count(x.size, ratio))


def _header(c=codec.ONEBIT, flags=0, param=0, n=8, k=8, scale=1.0):
    return struct.pack("<BBHIIf", c, flags, param, n, k, scale)


MALFORMED = {
    "truncated header": b"\x01\x00\x00",
    "unknown codec": _header(c=9) + b"\0" * 4,
    "unknown flags": _header(flags=16) + b"\0" * 4,
    "unknown flags 12": _header(flags=12) + b"\0" * 4,  # export and import at once
    "piece index is not a whole number": _header(flags=4, scale=1.5) + b"\0" * 4,
    "empty chunk": _header(n=0, k=0),
    "entries for": _header(k=7) + b"\0" * 4,
    "parameter 0 out of range": _header(c=codec.DITHERING, n=4, k=4) + b"\0" * 4,
    "bytes announced": _header(n=1 << 20, k=1 << 20),
    "not increasing": _header(c=codec.TOPK, n=8, k=2) + struct.pack("<II", 3, 3) + b"\0" * 8,
    "level out of range": _header(c=codec.DITHERING, param=2, n=4, k=4) + bytes([0, 3, 0, 0]),
}


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_malformed_blobs_are_refused_with_what_is_wrong(what):
    with pytest.raises(MismatchError, match=what):
        CompressedRounds().round(1, 0, [MALFORMED[what]])


def test_top_k_index_past_the_chunk_is_refused():
    blob = _header(c=codec.TOPK, n=8, k=1) + struct.pack("<I", 8) + b"\0" * 4
    with pytest.raises(MismatchError, match="not increasing within the chunk"):
        CompressedRounds().round(1, 0, [blob])


def test_workers_that_compress_differently_all_get_one_error():
    a = codec.encode(codec.TOPK, np.arange(8, dtype=np.float32), k=2)
    b = codec.encode(codec.TOPK, np.arange(16, dtype=np.float32), k=2)  # same length, other chunk size
    assert len(a) == len(b)
    with pytest.raises(MismatchError):
        CompressedRounds().round(1, 0, [a, b])


def _push_pull_compressed(worker, name, data, blob_size):
    out = np.empty_like(data)
    h = worker.enqueue(name, "compressed", [data.size], data, out, Op.SUM, partition_bytes=blob_size)
    wait(worker, h)
    return out


@pytest.mark.usefixtures("transport")
@pytest.mark.parametrize("name,spec", CASES[::2], ids=[c[0] for c in CASES[::2]])
def test_through_real_servers_every_worker_gets_the_reference_answer(name, spec):
    sizes = (1000, 1000, 1000, 123)  # four partitions of one blob each, over two servers
    rng = np.random.default_rng(0)
    with InProcessCluster(3, 2) as c:
        residuals = {}
        for step in range(3):
            pushes = [np.frombuffer(_tensor_blobs(rng, spec, sizes), np.uint8).copy() for _ in range(3)]
            blob_size = len(_tensor_blobs(rng, spec, sizes[:1]))

            def job(rank, w):
                return _push_pull_compressed(w, "g", pushes[rank], blob_size).tobytes()

            results = c.run_all(job)
            # The reference per partition: each is its own key with its own residual.
            expect, off = [], 0
            for i, n in enumerate(sizes):
                size = len(_tensor_blobs(np.random.default_rng(1), spec, (n,)))
                parts = [p[off:off + size].tobytes() for p in pushes]
                expect.append(codec.server_round(parts, residuals.setdefault(i, {})))
                off += size
            for r in results:
                assert r == b"".join(expect)


@pytest.mark.usefixtures("transport")
def test_compressed_ops_must_be_sums_and_not_broadcasts():
    with InProcessCluster(2, 1) as c:
        data = np.frombuffer(codec.encode(codec.ONEBIT, np.ones(8, np.float32)), np.uint8).copy()
        w = c.workers[0]
        for op in (Op.AVERAGE, Op.BROADCAST):
            with pytest.raises(ConfigError, match="compressed tensors are push_pulled with Op.SUM"):
                w.enqueue("g", "compressed", [data.size], data, np.empty_like(data), op)


@pytest.mark.usefixtures("transport")
def test_a_garbage_push_fails_its_sender_and_the_job_goes_on():
    with InProcessCluster(2, 1) as c:
        garbage = np.full(20, 0xFF, np.uint8)

        def bad(rank, w):
            h = w.enqueue("bad", "compressed", [garbage.size], garbage, np.empty_like(garbage), Op.SUM)
            with pytest.raises(BpsError, match="unknown codec 255"):
                wait(w, h)

        c.run_all(bad)
        good = [np.frombuffer(codec.encode(codec.ONEBIT, np.full(8, r + 1.0, np.float32)), np.uint8).copy()
                for r in range(2)]
        res = c.run_all(lambda rank, w: _push_pull_compressed(w, "ok", good[rank], good[rank].size))
        np.testing.assert_array_equal(codec.decode_all(res[0].tobytes()), np.full(8, 3.0, np.float32))


def test_hierarchical_mode_sends_compressed_tensors_past_the_local_group():
    # Blobs cannot be summed byte-wise in shared memory: each rank pushes its own.
    with InProcessCluster(4, 2, local_size=2, hierarchical=True) as c:
        pushes = [np.frombuffer(codec.encode(codec.ONEBIT, np.full(8, r - 1.5, np.float32)), np.uint8).copy()
                  for r in range(4)]
        for step in range(2):
            res = c.run_all(lambda rank, w: _push_pull_compressed(w, "h", pushes[rank], pushes[rank].size))
            expect = codec.server_round([p.tobytes() for p in pushes], {})
            assert all(r.tobytes() == expect for r in res)


@pytest.mark.timeout(120)
def test_server_residuals_survive_a_checkpoint_and_a_new_job(tmp_path):
    # Job 1 exports the servers' residuals mid-training; job 2 (fresh servers) imports
    # them and its next rounds answer exactly what job 1's did.
    script = Path(__file__).parent / "scripts" / "server_state_roundtrip.py"
    state = tmp_path / "state.npz"
    for phase in ("first", "resume"):
        r = subprocess.run([sys.executable, "-m", "bpstrain.launch", "--workers", "2", "--servers", "2", "--",
                            sys.executable, str(script)], capture_output=True, text=True, timeout=100,
                           env={**os.environ, "PHASE": phase, "STATE_FILE": str(state)})
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.count("STATE_OK") == 2, r.stdout + r.stderr


def test_an_overflow_reaches_the_workers_but_never_stays_in_the_residual():
    server, residuals = CompressedRounds(), {}
    inf = codec.encode(codec.ONEBIT, np.float32([np.inf, 1, -1, 2]))
    ok = codec.encode(codec.ONEBIT, np.float32([1, 1, -1, 2]))
    first = codec.decode_all(server.round(1, 0, [inf, ok]))
    assert not np.all(np.isfinite(first))  # a loss scaler sees the overflow
    assert codec.server_round([inf, ok], residuals) == server.round(2, 0, [inf, ok])
    assert np.all(np.isfinite(residuals[0]))
    after = codec.decode_all(server.round(1, 1, [ok, ok]))
    assert np.all(np.isfinite(after))  # the next round is clean
