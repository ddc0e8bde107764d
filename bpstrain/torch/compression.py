"""Gradient compression applied around push_pull (Horovod/BytePS ``Compression``).

    >>> import torch
    >>> from bpstrain.torch.compression import Compression
    >>> small, ctx = Compression.fp16.compress(torch.ones(3))
    >>> small.dtype, Compression.fp16.decompress(small, ctx).dtype
    (torch.float16, torch.float32)
"""

from __future__ import annotations

from typing import Any, Tuple

import torch


class Compressor:
    """Interface: ``compress`` before sending, ``decompress`` after receiving."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Returns the tensor to send and a context for :meth:`decompress`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
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
        dtype = tensor.dtype
        if tensor.dtype.is_floating_point and dtype != torch.float16:
            tensor = tensor.to(torch.float16)
        return tensor, dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None or tensor.dtype == ctx else tensor.to(ctx)


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
