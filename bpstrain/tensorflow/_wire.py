"""The blobs of :mod:`bpstrain._codec` built and read with TensorFlow ops, and their transfer.

Encoding runs where the tensor is (a GPU tensor is compressed on the GPU) and inside
``tf.function``; only the bytes cross to the engine. The static parts of a blob (codec,
flags, n, k) are known when the graph is built, so a blob is the 12 fixed header bytes,
the scale's 4 bytes (``tf.bitcast``: little-endian, as the wire format is, on every
platform TensorFlow runs on) and the payload. The servers answer with blobs of the same
layout, so :func:`decode` reads their answer with the same static parts.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from bpstrain import _codec, _group, engine
from bpstrain.engine import Op

COMPRESSED = "compressed"
"""The engine dtype of blob byte strings (element size 1, summed by the servers' codec)."""


def _pad4(n: int) -> int:
    return (n + 3) & ~3


def _fixed_header(codec: int, flags: int, param: int, n: int, k: int) -> tf.Tensor:
    head = _codec.HEADER.pack(codec, flags, param, n, k, 0.0)[:12]
    return tf.constant(np.frombuffer(head, np.uint8))


def _bytes_of(tensor) -> tf.Tensor:
    """The little-endian bytes of a 1-d int32/float32 tensor, flat uint8."""
    return tf.reshape(tf.bitcast(tensor, tf.uint8), [-1])


def _padded(payload: tf.Tensor, size: int) -> tf.Tensor:
    pad = size - int(payload.shape[0])
    return tf.concat([payload, tf.zeros([pad], tf.uint8)], 0) if pad else payload


def _scale64(x: tf.Tensor, how: str) -> tf.Tensor:
    # float64 then one rounding to float32, as the reference (exact across implementations).
    a = tf.abs(tf.cast(x, tf.float64))
    if how == "mean":
        return tf.cast(tf.reduce_sum(a) / float(int(x.shape[0])), tf.float32)
    return tf.cast(tf.reduce_max(a), tf.float32)


class Layout:
    """The static shape of one tensor's byte string: its chunks and each blob's ``k``.

    Args:
        codec: ``_codec.ONEBIT``, ``TOPK`` or ``DITHERING``.
        numel: Elements of the flat tensor.
        chunk: Elements per blob (the last may be shorter).
        ratio: top-k share of each chunk.
        levels: dithering levels.
        scaled: onebit with scaling.
        server_ef: ask the servers to keep an error-feedback residual.
    """

    def __init__(self, codec: int, numel: int, chunk: int = _codec.DEFAULT_CHUNK,
                 ratio: float = 0.0, levels: int = 0, scaled: bool = True,
                 server_ef: bool = True):
        self.codec, self.levels, self.scaled = codec, levels, scaled
        self.chunks = _codec.chunk_sizes(numel, chunk)
        self.ks = [_codec.topk_count(n, ratio) if codec == _codec.TOPK else n
                   for n in self.chunks]
        self.flags = (_codec.FLAG_SERVER_EF if server_ef else 0) | (
            _codec.FLAG_SCALED if codec == _codec.ONEBIT and scaled else 0)
        self.blob_sizes = [_codec.blob_bytes(codec, n, k) for n, k in zip(self.chunks, self.ks)]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole byte string."""
        return sum(self.blob_sizes)

    @property
    def partition_bytes(self) -> int:
        """The blob size of a full chunk: engine partitions then hold whole blobs."""
        return self.blob_sizes[0]


def encode_chunk(layout: Layout, i: int, x: tf.Tensor, u: Optional[tf.Tensor] = None) -> tf.Tensor:
    """The blob (uint8) of chunk ``i``, the flat float32 tensor ``x``; see ``_codec.encode``.

    ``u``: dithering's uniform [0, 1) numbers (float64) for stochastic rounding;
    ``None`` rounds to the nearest level.
    """
    codec, n, k = layout.codec, layout.chunks[i], layout.ks[i]
    param = layout.levels if codec == _codec.DITHERING else 0
    head = _fixed_header(codec, layout.flags, param, n, k)
    if codec == _codec.ONEBIT:
        scale = _scale64(x, "mean") if layout.scaled else tf.constant(1.0, tf.float32)
        nbytes = _pad4((n + 7) // 8)
        neg = tf.pad(tf.cast(x < 0, tf.int32), [[0, 8 * nbytes - n]])
        weights = tf.constant([1 << b for b in range(8)], tf.int32)  # bit j % 8 of byte j // 8
        payload = tf.cast(tf.reduce_sum(tf.reshape(neg, [nbytes, 8]) * weights, 1), tf.uint8)
    elif codec == _codec.TOPK:
        scale = tf.constant(0.0, tf.float32)
        # top_k lists equal magnitudes lower index first (the reference's tie-break).
        idx = tf.sort(tf.math.top_k(tf.abs(x), k, sorted=True).indices)
        payload = tf.concat([_bytes_of(idx), _bytes_of(tf.gather(x, idx))], 0)
    elif codec == _codec.DITHERING:
        scale = _scale64(x, "max")
        s64 = tf.cast(scale, tf.float64)
        usable = tf.logical_and(s64 > 0, tf.math.is_finite(s64))
        t = tf.abs(tf.cast(x, tf.float64)) / tf.where(usable, s64, 1.0) * float(param)
        q = tf.floor(t + (0.5 if u is None else u))
        q = tf.minimum(q, float(param)) * tf.sign(tf.cast(x, tf.float64))
        q = tf.where(usable, q, tf.zeros_like(q))
        payload = _padded(tf.bitcast(tf.cast(q, tf.int8), tf.uint8), _pad4(n))
    else:
        raise ValueError(f"unknown codec {codec}")
    return tf.concat([head, _bytes_of(tf.reshape(scale, [1])), payload], 0)


def decode_chunk(layout: Layout, i: int, blob: tf.Tensor) -> tf.Tensor:
    """The flat float32 chunk ``i`` of ``blob`` (uint8, the layout's blob); see
    ``_codec.decode``."""
    codec, n, k = layout.codec, layout.chunks[i], layout.ks[i]
    h = _codec.HEADER_BYTES
    scale = tf.bitcast(blob[h - 4:h], tf.float32)
    if codec == _codec.ONEBIT:
        bits = tf.cast(blob[h:h + (n + 7) // 8], tf.int32)
        neg = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits[:, None], tf.range(8)), 1)
        neg = tf.reshape(neg, [-1])[:n]
        return tf.where(neg > 0, -scale, scale)
    if codec == _codec.TOPK:
        idx = tf.bitcast(tf.reshape(blob[h:h + 4 * k], [k, 4]), tf.int32)
        vals = tf.bitcast(tf.reshape(blob[h + 4 * k:h + 8 * k], [k, 4]), tf.float32)
        return tf.scatter_nd(idx[:, None], vals, [n])
    if codec == _codec.DITHERING:
        q = tf.bitcast(blob[h:h + n], tf.int8)
        return tf.cast(q, tf.float32) * (scale / np.float32(layout.levels))
    raise ValueError(f"unknown codec {codec}")


def encode(layout: Layout, flat: tf.Tensor, uniform=None) -> tf.Tensor:
    """The whole byte string (uint8) of the flat float32 tensor ``flat``.

    ``uniform``: ``n -> n float64 numbers in [0, 1)``, dithering's stochastic rounding;
    None rounds to the nearest level.
    """
    blobs, start = [], 0
    for i, n in enumerate(layout.chunks):
        part = flat[start:start + n]
        u = uniform(n) if uniform is not None else None
        blobs.append(encode_chunk(layout, i, part, u))
        start += n
    return tf.concat(blobs, 0) if len(blobs) > 1 else blobs[0]


def decode(layout: Layout, data: tf.Tensor) -> tf.Tensor:
    """The flat float32 tensor of a whole byte string of ``layout``."""
    parts, start = [], 0
    for i, size in enumerate(layout.blob_sizes):
        parts.append(decode_chunk(layout, i, data[start:start + size]))
        start += size
    return tf.concat(parts, 0) if len(parts) > 1 else parts[0]


# -- transfer -------------------------------------------------------------------------------

class Item:
    """One tensor of a transfer: how the engine moves it.

    Args:
        tensor: What to send (uint8 blobs for ``partition_bytes > 0``, else any dtype).
        name: Engine name, the same on every rank.
        average: Plain tensors: average (else sum). Blobs are always summed (the
            servers' codec sums; the compressor divides after decoding).
        partition_bytes: > 0: the tensor is a byte string of blobs of this size (the
            last may be shorter), sent as engine dtype ``"compressed"``.
        priority: Larger is sent sooner.
    """

    def __init__(self, tensor, name: str, average: bool = True, partition_bytes: int = 0,
                 priority: int = 0):
        self.tensor = tf.convert_to_tensor(tensor)
        self.name, self.average = name, average
        self.partition_bytes, self.priority = partition_bytes, priority


def submit_compressed(array: np.ndarray, name: str, priority: int, partition_bytes: int) -> int:
    """Queues the push_pull of one byte string of blobs; returns the engine handle."""
    src = np.ascontiguousarray(array, dtype=np.uint8).reshape(-1)
    dst = np.empty_like(src)
    return engine.submit(name, COMPRESSED, src.shape, src, dst, Op.SUM, priority=priority,
                         partition_bytes=partition_bytes)


def _start(item: Item, array: np.ndarray):
    if item.partition_bytes:
        # A global looked up at call time, so that a test can record the blobs sent.
        return lambda: submit_compressed(array, item.name, item.priority, item.partition_bytes)
    return lambda: engine.push_pull_async(array, name=item.name, average=item.average,
                                          priority=item.priority)


def transfer(items: Sequence[Item]) -> List[tf.Tensor]:
    """push_pulls every item as one group; eagerly or as one ``tf.numpy_function``.

    Returns tensors of the items' dtypes and static shapes.
    """
    items = list(items)
    if not items:
        return []

    @tf.autograph.experimental.do_not_convert  # plain Python, run by numpy_function
    def run(*arrays):
        return _group._run([_start(item, np.asarray(a)) for item, a in zip(items, arrays)])

    if tf.executing_eagerly():
        return [tf.convert_to_tensor(out) for out in run(*(i.tensor.numpy() for i in items))]
    from bpstrain.tensorflow._ops import check_not_xla

    check_not_xla()
    outs = tf.numpy_function(run, [i.tensor for i in items], [i.tensor.dtype for i in items],
                             stateful=True, name="bpstrain_push_pull_compressed")
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    for out, item in zip(outs, items):
        out.set_shape(item.tensor.shape)
    return list(outs)


def numel(shape) -> int:
    """Elements of a fully defined static shape."""
    return int(math.prod(int(d) for d in shape))

