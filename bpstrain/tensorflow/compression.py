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

from typing import Any, Tuple

import tensorflow as tf


class Compressor:
    """Interface: ``compress`` before sending, ``decompress`` after receiving."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        """Returns the tensor to send and a context for :meth:`decompress`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Undoes :meth:`compress` on the received tensor."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes); others unchanged."""

    @staticmethod
    def compress(tensor):
        tensor = tf.convert_to_tensor(tensor)
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.float16:
            tensor = tf.cast(tensor, tf.float16)
        return tensor, dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None or tensor.dtype == ctx else tf.cast(tensor, ctx)


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
