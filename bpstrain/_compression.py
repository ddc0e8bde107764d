"""The framework-neutral half of gradient compression (Horovod/BytePS ``Compression``):
the interface and the fp16 rule once; each adapter supplies its tensor operations
(:mod:`bpstrain.torch.compression`, :mod:`bpstrain.tensorflow.compression`)."""

from __future__ import annotations

from typing import Any, Tuple


class Compressor:
    """Interface: ``compress`` before sending, ``decompress`` after receiving."""

    @staticmethod
    def compress(tensor) -> Tuple[Any, Any]:
        """Returns the tensor to send and a context for :meth:`decompress`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx: Any):
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


class HalfCompressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes); others unchanged.

    Subclasses say how their framework does it: ``_prepare`` (turn the input into a
    tensor), ``_dtype``, ``_is_floating``, ``_cast`` and the ``_half`` dtype.
    """

    _half: Any = None

    @classmethod
    def _prepare(cls, tensor):
        return tensor

    @classmethod
    def compress(cls, tensor):
        tensor = cls._prepare(tensor)
        dtype = cls._dtype(tensor)
        if cls._is_floating(dtype) and dtype != cls._half:
            tensor = cls._cast(tensor, cls._half)
        return tensor, dtype

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None or cls._dtype(tensor) == ctx else cls._cast(tensor, ctx)
