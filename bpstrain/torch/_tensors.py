"""How torch tensors cross into the engine: engine dtypes, zero-copy numpy views, cutting.

The engine takes numpy arrays (buffer protocol). A contiguous CPU tensor crosses as
``tensor.numpy()``, which shares its memory, so the engine reads the input and writes
the result straight into tensor storage. numpy has no bfloat16, so a bfloat16 tensor
crosses as an int16 view of the same bytes and the engine is told ``dtype="bfloat16"``.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch

from bpstrain import engine

ENGINE_DTYPES: Dict[torch.dtype, str] = {getattr(torch, name): name for name in engine.DTYPES
                                         if name != "compressed"}
"""torch dtype -> engine dtype name, for every dtype the engine has (``"compressed"`` is
bytes of blobs, which :mod:`bpstrain.torch._compressors` submits itself)."""

DEFAULT_CHUNK_BYTES = 4 << 20
"""Bytes per staging chunk when ``comm.partition_bytes`` is 0 (the engine picks its own
partitions then; staging only needs pieces large enough to keep PCIe busy)."""


def engine_dtype(tensor: torch.Tensor) -> str:
    """The engine's name for ``tensor.dtype``.

    Raises:
        ValueError: the dtype has no engine counterpart (bool, complex, ...).
    """
    try:
        return ENGINE_DTYPES[tensor.dtype]
    except KeyError:
        supported = ", ".join(engine.DTYPES)
        raise ValueError(
            f"bpstrain.torch supports tensors of dtype {supported}; cast the tensor first. "
            f"Received: dtype={tensor.dtype}") from None


def host_view(tensor: torch.Tensor, shape: Tuple[int, ...] = None) -> np.ndarray:
    """A numpy array sharing memory with a contiguous CPU tensor (no copy).

    The one place where bfloat16 is reinterpreted: it crosses as int16 (the same
    bytes); :func:`from_host` turns such an array back into a tensor.

    Args:
        tensor: contiguous CPU tensor (pinned or not) that does not require grad.
        shape: reshape the view to this shape (default: the tensor's own; a 0-d
            tensor gives a 0-d array, which the engine takes with shape ``(1,)``).
    """
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    # reshape() of a contiguous tensor is a view.
    return (tensor if shape is None else tensor.reshape(shape)).numpy()


def from_host(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``dtype`` sharing memory with an array made by :func:`host_view`'s rules."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def chunk_bytes(partition_bytes: int) -> int:
    """Bytes per piece when an adapter cuts a tensor itself (``0`` = auto partitions)."""
    return int(partition_bytes) or DEFAULT_CHUNK_BYTES


def pieces(numel: int, per_piece: int) -> List[Tuple[int, int]]:
    """``[start, stop)`` of consecutive pieces of at most ``per_piece`` elements.

    The one way a tensor is cut in this adapter (CUDA staging chunks, hierarchical
    slices); at least one piece, also for an empty tensor.
    """
    per_piece = max(1, int(per_piece))
    return [(a, min(a + per_piece, numel)) for a in range(0, max(numel, 1), per_piece)]


def cut_layout(kind: str, piece_bytes: int, index: int, count: int, shape) -> str:
    """The ``layout`` a piece is declared with, so ranks that cut differently fail.

    It names how the whole tensor (``shape``) was cut, and which piece this is: two
    ranks whose pieces happen to have the same shape but come from different cuts or
    tensors still disagree.
    """
    dims = "x".join(str(int(d)) for d in shape) or "scalar"
    return f"{kind}:{piece_bytes}:{index}/{count}:{dims}"


def average_(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """Divides a sum over ``count`` ranks in place, as the engine's ``Op.AVERAGE`` does:
    floating tensors exactly, integers with floor division."""
    if tensor.is_floating_point():
        return tensor.div_(count)
    return tensor.copy_(torch.div(tensor, count, rounding_mode="floor"))
