"""Gradient compression applied around push_pull (Horovod/BytePS ``Compression``).

    >>> import torch
    >>> from bpstrain.torch.compression import Compression
    >>> small, ctx = Compression.fp16.compress(torch.ones(3))
    >>> small.dtype, Compression.fp16.decompress(small, ctx).dtype
    (torch.float16, torch.float32)
"""

from __future__ import annotations

import torch

from bpstrain._compression import Compressor, HalfCompressor, NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class FP16Compressor(HalfCompressor):
    """Sends floating-point tensors as float16 (half the bytes); others unchanged."""

    _half = torch.float16

    @staticmethod
    def _dtype(tensor):
        return tensor.dtype

    @staticmethod
    def _is_floating(dtype):
        return dtype.is_floating_point

    @staticmethod
    def _cast(tensor, dtype):
        return tensor.to(dtype)


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
