"""Checkpointing the servers' error-feedback residuals of compressed tensors.

Servers keep a residual per compressed partition (what their re-encoded answer left
out), so a resumed job equals an uninterrupted one only if those residuals come back
too. They travel through the tensor's own partitions, a piece per round
(:func:`bpstrain._codec.state_blob`): no other message type, and the same servers, keys
and authentication as the gradients. Both calls are **collective**: every rank calls
them for the same tensors in the same order (as for push_pull), and they cost about
one dense fp32 copy of the tensor on the wire.
"""

from __future__ import annotations

import numpy as np

from bpstrain import _codec, engine
from bpstrain._core import Op


def _rounds(name: str, pushes, blob_size: int):
    handles = []
    for push in pushes:
        src = np.frombuffer(push, np.uint8).copy()
        handles.append(engine.submit(name, "compressed", src.shape, src, np.empty_like(src), Op.SUM,
                                     partition_bytes=blob_size))
    return [engine.synchronize(h).tobytes() for h in handles]


def export_residual(name: str, template: bytes, blob_size: int) -> np.ndarray:
    """The servers' residual of compressed tensor ``name`` (flat fp32, chunks in order).

    ``template`` is any compressed push of the tensor (it gives the chunk layout) and
    ``blob_size`` the ``partition_bytes`` its pushes use. Zeros where no server has one.
    """
    numel = _numel(template)
    residual = np.zeros(numel, np.float32)
    pieces = range(_codec.state_pieces(template))
    answers = _rounds(name, [_codec.state_blob(template, p) for p in pieces], blob_size)
    for p, answer in zip(pieces, answers):
        _codec.read_state(answer, p, residual)
    return residual


def import_residual(name: str, template: bytes, blob_size: int, residual: np.ndarray) -> None:
    """Makes ``residual`` (from :func:`export_residual`) the servers' residual of ``name``;
    rank 0's copy wins where ranks differ."""
    residual = np.ascontiguousarray(residual, np.float32).ravel()
    if residual.size != _numel(template):
        raise ValueError(f"the residual of {name!r} has {residual.size} elements; the tensor has "
                         f"{_numel(template)}")
    pieces = range(_codec.state_pieces(template))
    _rounds(name, [_codec.state_blob(template, p, residual) for p in pieces], blob_size)


def _numel(template: bytes) -> int:
    total, off = 0, 0
    while off < len(template):
        codec, _, _, n, k, _ = _codec.parse_header(template, off)
        total += n
        off += _codec.blob_bytes(codec, n, k)
    return total
