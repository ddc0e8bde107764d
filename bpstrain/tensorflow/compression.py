"""Gradient compression around push_pull for TensorFlow (Horovod/BytePS ``Compression``).

The same interface as :mod:`bpstrain.torch.compression` (``compress`` returns the
tensor to send and a context, ``decompress`` undoes it), on TF tensors with
``tf.cast``, so it runs eagerly and inside ``tf.function``. It is a separate module
because that one is written against torch tensors and imports torch.

    >>> import tensorflow as tf
    >>> small, ctx = Compression.fp16.compress(tf.ones(3))
    >>> small.dtype, Compression.fp16.decompress(small, ctx).dtype
    (tf.float16, tf.float32)
"""

from __future__ import annotations

import tensorflow as tf

from bpstrain._compression import Compressor, HalfCompressor, NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor", "check_compression"]


class FP16Compressor(HalfCompressor):
    """Sends floating-point tensors as float16 (half the bytes); others unchanged."""

    _half = tf.float16

    @staticmethod
    def _prepare(tensor):
        return tf.convert_to_tensor(tensor)

    @staticmethod
    def _dtype(tensor):
        return tensor.dtype

    @staticmethod
    def _is_floating(dtype):
        return dtype.is_floating

    @staticmethod
    def _cast(tensor, dtype):
        return tf.cast(tensor, dtype)


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def check_compression(compression) -> None:
    """Raises ValueError unless ``compression`` has ``compress`` and ``decompress``."""
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise ValueError("compression must be Compression.none, Compression.fp16 or an object "
                         f"with compress() and decompress(). Received: compression={compression!r}")
