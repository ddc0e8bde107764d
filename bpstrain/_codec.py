"""The wire format of compressed gradients, shared by every adapter and the servers.

A compressed tensor travels as engine dtype ``"compressed"``: a byte string made of
**blobs**, one per chunk of at most ``chunk`` elements of the flat fp32 gradient. Each
blob is self-contained, so the engine can cut the byte string into partitions of whole
blobs (the adapters pass ``partition_bytes`` = a multiple of the blob size) and a server
decodes each partition on its own. The servers (``core_ext/src/codec.cc``) decode the
workers' blobs in rank order, sum them in fp32, add their own error-feedback residual,
encode the sum again with the same codec and answer every worker with that blob — so the
pull is compressed as well as the push (BytePS's "decompress, sum, recompress").

Blob layout, little-endian, 16-byte header then payload padded to 4 bytes::

    u8  codec     1 = onebit, 2 = topk, 3 = dithering
    u8  flags     bit 0: onebit scaled (else the magnitude is 1)
                  bit 1: the server keeps an error-feedback residual for this chunk
                  bit 2 / bit 3: a state export / import blob (see below)
    u16 param     dithering: levels s (1..127); else 0
    u32 n         elements of the chunk (>= 1)
    u32 k         payload entries: topk k (1..n); onebit and dithering n
    f32 scale     onebit: magnitude; dithering: max |x|; topk: 0
    payload       onebit: ceil(n/8) bytes, bit (j % 8) of byte j // 8 set iff x[j] < 0
                  topk: k u32 indices, strictly increasing, < n; then k f32 values
                  dithering: n int8 levels in [-s, s]; value = level * f32(scale / s)

The encoders here are the **reference**: the servers' encoder must give the same bytes
(``server_round``), and an adapter's encoder must give blobs that ``decode`` reads
back to what the adapter kept as its residual. Rules that make results exact across
implementations: scales are computed in float64 and rounded to float32 once; top-k
breaks ties in magnitude by the lower index and lists indices in increasing order;
dithering on the servers rounds to the nearest level (ties away from zero); workers may
round stochastically (``u``).

**Checkpointing the servers' residuals** goes through the tensor's own partitions, one
piece per round: a state blob has the gradient blob's header (same size) with bit 2
(export) or bit 3 (import) set and the piece index in ``scale``; its payload is raw fp32
residual, :func:`state_floats` of it per chunk. An export round answers piece p of each
chunk's residual and changes nothing; an import round makes the lowest rank's payload
piece p of the residual (:func:`state_blob`, :func:`read_state`).

Random-k needs no codec: every rank derives the same ``k`` indices from a shared seed
(:func:`randomk_indices`), so the servers sum plain float32 values.
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

ONEBIT, TOPK, DITHERING = 1, 2, 3
CODECS = {"onebit": ONEBIT, "topk": TOPK, "dithering": DITHERING}
FLAG_SCALED = 1
FLAG_SERVER_EF = 2
FLAG_STATE_EXPORT = 4
FLAG_STATE_IMPORT = 8
HEADER = struct.Struct("<BBHIIf")
HEADER_BYTES = HEADER.size  # 16
DEFAULT_CHUNK = 1 << 20
"""Elements per blob: a 4 MB fp32 chunk, so a large tensor spreads over the servers."""


def _pad4(n: int) -> int:
    return (n + 3) & ~3


def topk_count(n: int, ratio: float) -> int:
    """Entries a top-k blob of an ``n``-element chunk carries: ceil(ratio * n), 1..n."""
    return min(n, max(1, int(math.ceil(ratio * n))))


def blob_bytes(codec: int, n: int, k: int = 0) -> int:
    """Size of one blob, header included."""
    if codec == ONEBIT:
        return HEADER_BYTES + _pad4((n + 7) // 8)
    if codec == TOPK:
        return HEADER_BYTES + 8 * k
    if codec == DITHERING:
        return HEADER_BYTES + _pad4(n)
    raise ValueError(f"unknown codec {codec}")


def chunk_sizes(numel: int, chunk: int = DEFAULT_CHUNK) -> List[int]:
    """Elements of each chunk of a flat tensor of ``numel`` elements (all ``chunk`` but the last)."""
    if numel <= 0:
        return []
    full, rest = divmod(numel, chunk)
    return [chunk] * full + ([rest] if rest else [])


def compressed_bytes(codec: int, numel: int, chunk: int = DEFAULT_CHUNK, ratio: float = 0.0) -> int:
    """Bytes of a whole compressed tensor."""
    return sum(blob_bytes(codec, n, topk_count(n, ratio) if codec == TOPK else n)
               for n in chunk_sizes(numel, chunk))


def _scale64(values: np.ndarray, how: str) -> np.float32:
    a = np.abs(values.astype(np.float64))
    if how == "mean":
        return np.float32(a.sum() / a.size)
    return np.float32(a.max()) if a.size else np.float32(0)


# -- encode -------------------------------------------------------------------------------

def encode(codec: int, x: np.ndarray, *, scaled: bool = True, levels: int = 0, k: int = 0,
           server_ef: bool = True, u: Optional[np.ndarray] = None) -> bytes:
    """One blob of the fp32 chunk ``x``.

    ``u`` (dithering only): uniform [0, 1) numbers for stochastic rounding, one per
    element; ``None`` rounds to the nearest level (what the servers do).
    """
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    n = x.size
    if n < 1:
        raise ValueError("a blob holds at least one element")
    flags = FLAG_SERVER_EF if server_ef else 0
    if codec == ONEBIT:
        flags |= FLAG_SCALED if scaled else 0
        scale = _scale64(x, "mean") if scaled else np.float32(1)
        bits = np.packbits((x < 0).astype(np.uint8), bitorder="little")
        payload = bits.tobytes().ljust(_pad4(bits.size), b"\0")
        return HEADER.pack(ONEBIT, flags, 0, n, n, float(scale)) + payload
    if codec == TOPK:
        if not 1 <= k <= n:
            raise ValueError(f"top-k needs 1 <= k <= n. Received: k={k}, n={n}")
        order = np.argsort(-np.abs(x), kind="stable")[:k]  # ties: the lower index first
        idx = np.sort(order).astype(np.uint32)
        return HEADER.pack(TOPK, flags, 0, n, k, 0.0) + idx.tobytes() + x[idx].tobytes()
    if codec == DITHERING:
        if not 1 <= levels <= 127:
            raise ValueError(f"dithering needs 1 <= levels <= 127. Received: levels={levels}")
        scale = _scale64(x, "max")
        if scale == 0 or not np.isfinite(scale):
            q = np.zeros(n, np.int8)
        else:
            t = np.abs(x.astype(np.float64)) / np.float64(scale) * levels
            q = np.floor(t + (0.5 if u is None else np.asarray(u, np.float64)))
            q = (np.minimum(q, levels) * np.sign(x)).astype(np.int8)
        return HEADER.pack(DITHERING, flags, levels, n, n, float(scale)) + q.tobytes().ljust(_pad4(n), b"\0")
    raise ValueError(f"unknown codec {codec}")


# -- decode -------------------------------------------------------------------------------

def parse_header(blob: bytes, offset: int = 0) -> Tuple[int, int, int, int, int, np.float32]:
    """(codec, flags, param, n, k, scale) of the blob at ``offset``."""
    codec, flags, param, n, k, scale = HEADER.unpack_from(blob, offset)
    return codec, flags, param, n, k, np.float32(scale)


def decode(blob: bytes, offset: int = 0) -> Tuple[np.ndarray, int]:
    """The fp32 chunk of the blob at ``offset`` and the offset after it."""
    codec, flags, param, n, k, scale = parse_header(blob, offset)
    p = offset + HEADER_BYTES
    if codec == ONEBIT:
        bits = np.frombuffer(blob, np.uint8, (n + 7) // 8, p)
        neg = np.unpackbits(bits, count=n, bitorder="little").astype(bool)
        out = np.where(neg, -scale, scale).astype(np.float32)
    elif codec == TOPK:
        idx = np.frombuffer(blob, np.uint32, k, p)
        vals = np.frombuffer(blob, np.float32, k, p + 4 * k)
        out = np.zeros(n, np.float32)
        out[idx] = vals
    elif codec == DITHERING:
        q = np.frombuffer(blob, np.int8, n, p)
        out = q.astype(np.float32) * (np.float32(scale) / np.float32(param))
    else:
        raise ValueError(f"unknown codec {codec}")
    return out, offset + blob_bytes(codec, n, k)


def decode_all(data: bytes) -> np.ndarray:
    """The flat fp32 tensor of a whole compressed byte string."""
    parts, off = [], 0
    while off < len(data):
        chunk, off = decode(data, off)
        parts.append(chunk)
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


# -- the servers' rule --------------------------------------------------------------------

def server_round(blobs: Sequence[bytes], residuals: Optional[Dict[int, np.ndarray]] = None) -> bytes:
    """What a server answers for one round: ``blobs`` are the workers' byte strings in
    rank order (each a sequence of blobs); ``residuals`` (chunk index -> fp32 array) is
    the server's error-feedback state, updated in place.
    """
    residuals = {} if residuals is None else residuals
    if parse_header(blobs[0])[1] & (FLAG_STATE_EXPORT | FLAG_STATE_IMPORT):
        return _state_round(blobs[0], residuals)
    out, off, i = [], 0, 0
    while off < len(blobs[0]):
        codec, flags, param, n, k, _ = parse_header(blobs[0], off)
        total = None
        for b in blobs:
            chunk, _ = decode(b, off)
            total = chunk.copy() if total is None else total + chunk
        if flags & FLAG_SERVER_EF:
            total = total + residuals.get(i, np.zeros(n, np.float32))
        blob = encode(codec, total, scaled=bool(flags & FLAG_SCALED), levels=param, k=k,
                      server_ef=bool(flags & FLAG_SERVER_EF))
        if flags & FLAG_SERVER_EF:
            # A non-finite sum reaches the workers; the residual never keeps it.
            with np.errstate(invalid="ignore"):
                r = total - decode(blob)[0]
            residuals[i] = np.where(np.isfinite(r), r, np.float32(0))
        out.append(blob)
        off += blob_bytes(codec, n, k)
        i += 1
    return b"".join(out)


def _state_round(lowest: bytes, residuals: Dict[int, np.ndarray]) -> bytes:
    out, off, i = bytearray(lowest), 0, 0
    while off < len(lowest):
        codec, flags, _, n, k, piece = parse_header(lowest, off)
        per, size = state_floats(codec, n, k), blob_bytes(codec, n, k)
        res = residuals.setdefault(i, np.zeros(n, np.float32))
        begin = min(n, int(piece) * per)
        count = min(per, n - begin)
        p = off + HEADER_BYTES
        if flags & FLAG_STATE_IMPORT:
            res[begin:begin + count] = np.frombuffer(lowest, np.float32, count, p)
        else:
            out[p:off + size] = bytes(size - HEADER_BYTES)
            out[p:p + 4 * count] = res[begin:begin + count].tobytes()
        off += size
        i += 1
    return bytes(out)


# -- checkpointing the servers' residuals ---------------------------------------------------

def state_floats(codec: int, n: int, k: int) -> int:
    """Residual floats one state piece of a blob carries."""
    return (blob_bytes(codec, n, k) - HEADER_BYTES) // 4


def state_pieces(template: bytes) -> int:
    """Rounds an export or import of a tensor takes (its template: any gradient push)."""
    pieces, off = 0, 0
    while off < len(template):
        codec, _, _, n, k, _ = parse_header(template, off)
        pieces = max(pieces, -(-n // state_floats(codec, n, k)))
        off += blob_bytes(codec, n, k)
    return pieces


def state_blob(template: bytes, piece: int, residual: Optional[np.ndarray] = None) -> bytes:
    """The push of state round ``piece``: an export without ``residual``, else an import
    of the tensor's flat fp32 ``residual`` (chunks in order)."""
    out, off, first = bytearray(len(template)), 0, 0
    while off < len(template):
        codec, flags, param, n, k, _ = parse_header(template, off)
        flags = (flags & ~(FLAG_STATE_EXPORT | FLAG_STATE_IMPORT)) | (
            FLAG_STATE_EXPORT if residual is None else FLAG_STATE_IMPORT)
        per, size = state_floats(codec, n, k), blob_bytes(codec, n, k)
        out[off:off + HEADER_BYTES] = HEADER.pack(codec, flags, param, n, k, float(piece))
        if residual is not None:
            begin = min(n, piece * per)
            count = min(per, n - begin)
            chunk = np.ascontiguousarray(residual[first + begin:first + begin + count], np.float32)
            out[off + HEADER_BYTES:off + HEADER_BYTES + 4 * count] = chunk.tobytes()
        off += size
        first += n
    return bytes(out)


def read_state(answer: bytes, piece: int, residual: np.ndarray) -> None:
    """Writes the export answer of round ``piece`` into the flat fp32 ``residual``."""
    off, first = 0, 0
    while off < len(answer):
        codec, _, _, n, k, _ = parse_header(answer, off)
        per = state_floats(codec, n, k)
        begin = min(n, piece * per)
        count = min(per, n - begin)
        residual[first + begin:first + begin + count] = np.frombuffer(answer, np.float32, count,
                                                                      off + HEADER_BYTES)
        off += blob_bytes(codec, n, k)
        first += n


# -- random-k -----------------------------------------------------------------------------

def randomk_indices(n: int, k: int, seed: int, name: str, step: int) -> np.ndarray:
    """The ``k`` distinct indices in [0, n) that every rank picks for tensor ``name`` at
    ``step``: the affine sequence (a + j*b) mod n with gcd(b, n) = 1, a and b drawn from
    a hash of (seed, name, step). Pure integer arithmetic, so every framework and device
    gets the same indices; cost O(k)."""
    if not 1 <= k <= n:
        raise ValueError(f"random-k needs 1 <= k <= n. Received: k={k}, n={n}")
    a, b = randomk_affine(n, seed, name, step)
    return ((a + np.arange(k, dtype=np.int64) * b) % n).astype(np.int64)


def randomk_affine(n: int, seed: int, name: str, step: int) -> Tuple[int, int]:
    """(a, b) of :func:`randomk_indices`, for adapters that build the sequence on a device."""
    h = hashlib.blake2b(f"{seed}/{name}/{step}".encode(), digest_size=16).digest()
    a = int.from_bytes(h[:8], "little") % n
    if n == 1:
        return 0, 1
    b = 1 + int.from_bytes(h[8:], "little") % (n - 1)
    while math.gcd(b, n) != 1:
        b = b % (n - 1) + 1
    return a, b
