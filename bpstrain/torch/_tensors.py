"""How torch tensors cross into the engine: engine dtypes and zero-copy numpy views.

The engine takes numpy arrays (buffer protocol). A contiguous CPU tensor crosses as
``tensor.numpy()``, which shares its memory, so the engine reads the input and writes
the result straight into tensor storage. numpy has no bfloat16, so a bfloat16 tensor
crosses as an int16 view of the same bytes and the engine is told ``dtype="bfloat16"``.
"""

from __future__ import annotations

import zlib
from typing import Tuple

import numpy as np
import torch

_ENGINE_DTYPES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
}

# Shape of the small int64 op that checks the layout of chunked CUDA tensors across
# ranks (see bpstrain.torch._cuda). Eight dimensions: no user tensor of one chunk has
# this exact signature, so a rank that does not chunk always collides with it loudly.
LAYOUT_SHAPE: Tuple[int, ...] = (1, 1, 1, 1, 1, 1, 1, 2)


def engine_dtype(tensor: torch.Tensor) -> str:
    """The engine's name for ``tensor.dtype``.

    Raises:
        ValueError: the dtype has no engine counterpart (bool, complex, ...).
    """
    try:
        return _ENGINE_DTYPES[tensor.dtype]
    except KeyError:
        supported = ", ".join(str(d).replace("torch.", "") for d in _ENGINE_DTYPES)
        raise ValueError(
            f"bpstrain.torch supports tensors of dtype {supported}; cast the tensor first. "
            f"Received: dtype={tensor.dtype}") from None


def host_view(tensor: torch.Tensor, shape: Tuple[int, ...] = None) -> np.ndarray:
    """A numpy array sharing memory with a contiguous CPU tensor (no copy).

    Args:
        tensor: contiguous CPU tensor (pinned or not).
        shape: reshape the view to this shape (default: the tensor's shape, 0-d -> (1,)).
    """
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if shape is None:
        shape = tuple(t.shape) or (1,)
    # reshape() of a contiguous tensor is a view; the engine rejects 0-d arrays' shapes.
    return t.reshape(shape).numpy()


def device_signature(tensor: torch.Tensor) -> Tuple[int, ...]:
    """Extra trailing dimensions that mark the device type in a declared shape.

    CUDA tensors are declared with one more dimension of size 1 than CPU tensors, so
    a name used with a CPU tensor on one rank and a CUDA tensor on another fails with
    a shape mismatch on every rank instead of silently mixing the two.
    """
    return (1,) if tensor.is_cuda else ()


def layout_hash(*parts) -> int:
    """A small positive integer identifying a layout; ranks compare it by summing."""
    # < 2**16 so that the sum of squares over thousands of ranks stays exact in int64.
    return 1 + zlib.crc32(repr(parts).encode()) % ((1 << 16) - 1)


def same_everywhere(sums: np.ndarray, size: int) -> bool:
    """Given the rank-sum of ``[h, h*h]``, tells whether every rank had the same ``h``.

    By Cauchy-Schwarz, ``(sum h)**2 <= size * sum h**2`` with equality only when all
    values are equal; integers make the comparison exact.
    """
    total, squares = int(sums.reshape(-1)[0]), int(sums.reshape(-1)[1])
    return total * total == size * squares
