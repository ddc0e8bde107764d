"""Gradient compression around push_pull (Horovod/BytePS ``Compression``, and more).

    >>> import torch
    >>> from bpstrain.torch.compression import Compression
    >>> small, ctx = Compression.fp16.compress(torch.ones(3))
    >>> small.dtype, Compression.fp16.decompress(small, ctx).dtype
    (torch.float16, torch.float32)

Horovod's stateless compressors keep their interface: ``Compression.none``,
``Compression.fp16`` and ``Compression.bf16`` (classes with ``compress``/
``decompress``; a user-written one works the same way). The lossy ones are objects that
hold per-tensor state (error-feedback residuals, step counters, PowerSGD's Q) and run
the whole push_pull themselves (:mod:`bpstrain.torch._compressors`)::

    opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=bps.Compression.topk(0.01))
    # or per tensor, by name and size (first matching rule wins):
    compression = bps.Compression.policy("onebit", rules=[("*.embedding.*", "fp16")],
                                         min_size=1024)
    # or one tensor, keeping the compressor for its state:
    comp = bps.Compression.powersgd(2)
    avg = bps.push_pull(grad, name="w", compression=comp)

In DistributedOptimizer lossy compression applies per parameter by name (rules match
parameter names); tensors under ``min_size`` elements (default 1024) stay uncompressed,
and fused buckets of small gradients use fp16/bf16 when that is the default, else
nothing. The compressor's state travels in the optimizer's ``state_dict()``. Spec
strings (``"topk:0.01"``, ``"auto:onebit"``, ...) are those of
:func:`bpstrain._compression.parse_compression`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from bpstrain._compression import (DEFAULT_MIN_SIZE, CompressionPolicy, CompressionSpec, Compressor,
                                   HalfCompressor, NoneCompressor)
from bpstrain.torch._compressors import (AutoCompressor, ByteCodecCompressor, ClassicCompressor,
                                         GradientCompressor, PolicyCompressor, PowerSGDCompressor,
                                         RandomKCompressor, from_spec)

__all__ = ["AutoCompressor", "BF16Compressor", "ByteCodecCompressor", "ClassicCompressor",
           "Compression", "Compressor", "FP16Compressor", "GradientCompressor", "NoneCompressor",
           "PolicyCompressor", "PowerSGDCompressor", "RandomKCompressor"]


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


class BF16Compressor(FP16Compressor):
    """Sends floating-point tensors as bfloat16: half the bytes, float32's range (no
    overflow of large gradients), 8 bits of mantissa."""

    _half = torch.bfloat16


def _spec(codec: str, **options: Any) -> CompressionSpec:
    from bpstrain._compression import parse_compression

    return parse_compression({"codec": codec, **{k: v for k, v in options.items() if v is not None}})


class Compression:
    """The available compressors.

    ``none``, ``fp16`` and ``bf16`` are stateless classes (Horovod's interface); the
    factories below return stateful compressors: keep the object for as long as the
    tensors it compresses live (it holds their residuals), or give it to a
    DistributedOptimizer, which takes a fresh copy of its own.
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def onebit(scaling: bool = True, error_feedback: bool = True,
               server_error_feedback: bool = True) -> GradientCompressor:
        """Signs only (1 bit per element) and one magnitude per chunk.

        Args:
            scaling: the magnitude is mean |x| of the chunk (else 1, as signSGD).
            error_feedback: keep what the bits lost and add it to the next gradient.
            server_error_feedback: the servers do the same for the sum they re-encode.
        """
        return from_spec(_spec("onebit", scaled=scaling, error_feedback=error_feedback,
                               server_error_feedback=server_error_feedback))

    @staticmethod
    def topk(ratio: float, error_feedback: bool = True, server_error_feedback: bool = True,
             momentum: float = 0.0) -> GradientCompressor:
        """The ``ceil(ratio * n)`` largest magnitudes per chunk, as (index, value) pairs.

        ``momentum``: DGC's momentum correction (Lin et al., 2018) for an SGD optimizer
        with this momentum (no dampening or Nesterov): the worker accumulates the velocity
        before sparsifying and clears it where it sent, and the optimizer's momentum
        buffer is handed what makes its update DGC's (``DistributedOptimizer`` checks the
        optimizer's momentum matches; with ``push_pull`` or DDP it is yours to match)."""
        return from_spec(_spec("topk", ratio=ratio, error_feedback=error_feedback,
                               server_error_feedback=server_error_feedback, momentum=momentum))

    @staticmethod
    def randomk(ratio: float, error_feedback: bool = True, seed: int = 0) -> GradientCompressor:
        """``ceil(ratio * n)`` entries at indices every rank derives from (seed, name,
        step), so only values travel and the servers sum plain float32."""
        return from_spec(_spec("randomk", ratio=ratio, error_feedback=error_feedback, seed=seed))

    @staticmethod
    def dithering(levels: int, stochastic: bool = True, error_feedback: bool = True,
                  server_error_feedback: bool = True, seed: int = 0) -> GradientCompressor:
        """int8 levels of max |x| per chunk (``levels`` in 1..127), rounded stochastically
        on the workers (unbiased) unless ``stochastic=False``."""
        return from_spec(_spec("dithering", levels=levels, stochastic=stochastic,
                               error_feedback=error_feedback,
                               server_error_feedback=server_error_feedback, seed=seed))

    @staticmethod
    def powersgd(rank: int, error_feedback: bool = True, seed: int = 0) -> GradientCompressor:
        """Rank-``rank`` approximation P Qᵀ of each matrix-shaped gradient (Vogels et al.);
        1-D gradients go uncompressed."""
        return from_spec(_spec("powersgd", rank=rank, error_feedback=error_feedback, seed=seed))

    @staticmethod
    def auto(compression: Any = "fp16", steps: int = 5,
             bandwidth: Optional[float] = None) -> GradientCompressor:
        """``compression`` per tensor where it saves more wire time than it costs, measured
        over the first ``steps`` steps (see :class:`bpstrain._compression.AutoPolicy`).

        Args:
            compression: the spec (``"onebit"``, ``"topk:0.01"``) or compressor to wrap.
            steps: measured steps before the (sticky) decision.
            bandwidth: link bytes per second to price saved bytes; None uses the
                engine's measured link, else one timed uncompressed push_pull per tensor.
        """
        inner = compression.spec if isinstance(compression, GradientCompressor) else compression
        spec = _spec("auto", inner=inner, steps=steps, bandwidth=bandwidth)
        if isinstance(compression, GradientCompressor):
            return AutoCompressor(spec, compression.fork())
        return from_spec(spec)

    @staticmethod
    def policy(default: Any = "none", rules: Sequence[Any] = (),
               min_size: int = DEFAULT_MIN_SIZE) -> PolicyCompressor:
        """Per-tensor choice by name and size (see :class:`bpstrain._compression.CompressionPolicy`).

        Args:
            default: spec (or compressor) of tensors no rule matches.
            rules: ordered ``(pattern, spec[, min_size])`` tuples or dicts
                ``{"pattern", "compression", "min_size"}``; patterns are globs on the
                tensor name (DistributedOptimizer: the parameter name).
            min_size: tensors with fewer elements are not compressed.
        """
        if isinstance(default, GradientCompressor):
            return PolicyCompressor(CompressionPolicy(default.spec, rules, min_size),
                                    default=default.fork())
        return PolicyCompressor(CompressionPolicy(default, rules, min_size))

    @staticmethod
    def from_spec(spec: Any) -> GradientCompressor:
        """The compressor of a spec string, dict or CompressionSpec (e.g. ``"topk:0.01"``)."""
        return from_spec(spec)
