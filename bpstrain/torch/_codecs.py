"""The blob codecs of :mod:`bpstrain._codec` in torch ops, on the tensor's own device.

Byte for byte the reference's encoding (bit order, top-k ties broken by the lower index,
indices ascending, scales computed in float64 and rounded to float32 once), but with no
host round trip: a CUDA gradient is encoded and decoded on its GPU and only the final
byte string is staged. Headers are built on the device too (the scale is a device
scalar), so encoding never waits for the GPU.

    data, sent = encode(spec, x)            # uint8 wire string, and what it decodes to
    y = decode(spec, data, x.numel())       # e.g. the servers' answer, as fp32
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from bpstrain import _codec, _core
from bpstrain._compression import CompressionSpec, blob_layout

_BIT_WEIGHTS: Dict[torch.device, torch.Tensor] = {}
_HEADERS: Dict[Tuple, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = _BIT_WEIGHTS[device] = (2 ** torch.arange(8)).to(torch.uint8).to(device)
    return w


def _header(codec: int, flags: int, param: int, n: int, k: int, scale: torch.Tensor) -> torch.Tensor:
    """The 16 header bytes on the scale's device: 12 constant bytes (cached) + the f32 scale."""
    key = (codec, flags, param, n, k, scale.device)
    head = _HEADERS.get(key)
    if head is None:
        raw = _codec.HEADER.pack(codec, flags, param, n, k, 0.0)[:12]
        head = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(scale.device)
        if len(_HEADERS) < 4096:  # one per distinct chunk shape; bounded all the same
            _HEADERS[key] = head
    return torch.cat([head, scale.to(torch.float32).reshape(1).view(torch.uint8)])


def _pad4(payload: torch.Tensor) -> torch.Tensor:
    extra = (-payload.numel()) % 4
    if not extra:
        return payload
    return torch.cat([payload, torch.zeros(extra, dtype=torch.uint8, device=payload.device)])


def _flags(spec: CompressionSpec) -> int:
    return _codec.FLAG_SERVER_EF if spec.server_error_feedback else 0


def encode_onebit(x: torch.Tensor, scaled: bool = True, flags: int = 0
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One onebit blob of the flat fp32 chunk ``x``; returns (blob bytes, decoded values)."""
    n = x.numel()
    if scaled:
        flags |= _codec.FLAG_SCALED
        total = x.abs().sum(dtype=torch.float64)  # |x| is exact in fp32: sum in fp64
        scale = (total / torch.full_like(total, n)).float()  # true division (see dithering)
    else:
        scale = torch.ones((), dtype=torch.float32, device=x.device)
    neg = x < 0
    bits = neg.view(torch.uint8)
    pad = (-n) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    # Bit j of byte i is element 8i + j: weights 1..128 summed in uint8 (no carries).
    packed = (bits.view(-1, 8) * _weights(x.device)).sum(1, dtype=torch.uint8)
    blob = torch.cat([_header(_codec.ONEBIT, flags, 0, n, n, scale), _pad4(packed)])
    return blob, torch.where(neg, -scale, scale)


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` indices of the largest magnitudes, ties to the lower index, ascending.

    ``torch.topk`` alone leaves ties in any order; the threshold pass below makes the
    choice the reference's (a stable sort by magnitude) in O(n).
    """
    a = x.abs()
    if k >= a.numel():
        return torch.arange(a.numel(), device=x.device)
    t = torch.topk(a, k, sorted=False).values.min()
    above = a > t
    at = a == t
    room = k - above.sum()
    mask = above | (at & (torch.cumsum(at, 0, dtype=torch.int64) <= room))
    return mask.nonzero().flatten()


def encode_topk(x: torch.Tensor, k: int, flags: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """One top-k blob of the flat fp32 chunk ``x``; returns (blob bytes, decoded values)."""
    n = x.numel()
    idx = topk_indices(x, k)
    vals = x[idx]
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    blob = torch.cat([_header(_codec.TOPK, flags, 0, n, k, zero),
                      idx.to(torch.int32).view(torch.uint8), vals.contiguous().view(torch.uint8)])
    sent = torch.zeros_like(x)
    sent[idx] = vals
    return blob, sent


def encode_dithering(x: torch.Tensor, levels: int, flags: int = 0,
                     u: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One dithering blob of the flat fp32 chunk ``x``; returns (blob bytes, decoded values).

    ``u``: uniform [0, 1) numbers for stochastic rounding (one per element); None rounds
    to the nearest level, as the servers do.
    """
    n = x.numel()
    scale = x.abs().max().float()  # max of fp32 values is exact: no float64 needed
    x64 = x.double()
    t = x64.abs() / scale.double() * levels
    q = torch.floor(t + (0.5 if u is None else u.double()))
    q = torch.minimum(q, torch.full_like(q, levels)) * torch.sign(x64)
    valid = (scale != 0) & torch.isfinite(scale)
    q = torch.where(valid, q, torch.zeros_like(q)).to(torch.int8)
    blob = torch.cat([_header(_codec.DITHERING, flags, levels, n, n, scale),
                      _pad4(q.view(torch.uint8))])
    # Both operands on the device: CUDA divides by a host scalar as a multiplication by
    # its reciprocal, one ulp off the reference's true division.
    return blob, q.to(torch.float32) * (scale / torch.full_like(scale, levels))


def _chunk_k(spec: CompressionSpec, n: int) -> int:
    return _codec.topk_count(n, spec.ratio) if spec.codec == "topk" else n


def encode(spec: CompressionSpec, x: torch.Tensor, uniforms: Optional[torch.Tensor] = None
           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The wire string of the flat fp32 tensor ``x`` under a byte codec, chunk by chunk.

    Returns:
        (uint8 tensor on x's device, the fp32 values it decodes to — the worker's
        error-feedback residual is ``x`` minus these).
    """
    flags = _flags(spec)
    blobs: List[torch.Tensor] = []
    sent: List[torch.Tensor] = []
    start = 0
    for n in _codec.chunk_sizes(x.numel(), spec.chunk):
        piece = x[start:start + n]
        if spec.codec == "onebit":
            blob, dec = encode_onebit(piece, spec.scaled, flags)
        elif spec.codec == "topk":
            blob, dec = encode_topk(piece, _chunk_k(spec, n), flags)
        elif spec.codec == "dithering":
            u = None if uniforms is None else uniforms[start:start + n]
            blob, dec = encode_dithering(piece, spec.levels, flags, u)
        else:
            raise ValueError(f"not a byte codec. Received: {spec}")
        blobs.append(blob)
        sent.append(dec)
        start += n
    if len(blobs) == 1:
        return blobs[0], sent[0]
    return torch.cat(blobs), torch.cat(sent)


def encode_host(spec: CompressionSpec, x: torch.Tensor, seed: int = 0, residual: bool = True,
                into: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """CPU tensors: the same bytes from the servers' C++ codec (chunks on several cores,
    10-30x the elementwise torch ops), and the residual ``x`` minus what they decode to
    (written into ``into`` when given, which may be ``x`` itself: no new buffer a step).

    ``seed`` != 0 rounds dithering stochastically from the codec's own per-chunk streams
    (so its bytes equal :func:`encode` only when rounding to nearest).
    """
    x = x.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    flags = _flags(spec) | (_codec.FLAG_SCALED if spec.codec == "onebit" and spec.scaled else 0)
    data = torch.empty(blob_layout(spec, x.numel())[0], dtype=torch.uint8)
    res = into if into is not None else (torch.empty_like(x) if residual else None)
    _core.codec_encode(x.numpy(), data.numpy(), None if res is None else res.numpy(),
                       spec.wire_codec, flags, spec.levels if spec.codec == "dithering" else 0,
                       spec.chunk, spec.ratio if spec.codec == "topk" else 0.0, seed)
    return data, res


def check_answer(data: torch.Tensor, numel: int, decode: bool = True) -> Optional[torch.Tensor]:
    """Checks a server's answer (host bytes, as it arrived) before anything trusts its
    indices or lengths, and decodes it into fp32 on the host unless ``decode`` is False
    (a CUDA tensor's answer is decoded on its GPU). Raises PeerError if malformed."""
    out = torch.empty(numel, dtype=torch.float32) if decode else None
    _core.codec_decode(data.numpy(), None if out is None else out.numpy())
    return out


def decode(spec: CompressionSpec, data: torch.Tensor, numel: int) -> torch.Tensor:
    """The flat fp32 tensor of a wire string made under ``spec`` (a worker's own, or the
    servers' answer, which has the same layout) on ``data``'s device.

    The layout follows from ``spec`` and ``numel``, so only the scales are read from the
    headers (on the device: no synchronisation).
    """
    out = torch.empty(numel, dtype=torch.float32, device=data.device)
    off, start = 0, 0
    for n in _codec.chunk_sizes(numel, spec.chunk):
        k = _chunk_k(spec, n)
        size = _codec.blob_bytes(spec.wire_codec, n, k)
        blob = data[off:off + size]
        p = _codec.HEADER_BYTES
        dst = out[start:start + n]
        if spec.codec == "onebit":
            scale = blob[12:16].view(torch.float32)
            packed = blob[p:p + (n + 7) // 8].unsqueeze(1)
            neg = (packed & _weights(data.device)).ne(0).flatten()[:n]
            torch.where(neg, -scale, scale, out=dst)
        elif spec.codec == "topk":
            idx = blob[p:p + 4 * k].view(torch.int32).long()
            dst.zero_()
            dst[idx] = blob[p + 4 * k:p + 8 * k].view(torch.float32)
        elif spec.codec == "dithering":
            scale = blob[12:16].view(torch.float32)
            step = scale / torch.full_like(scale, spec.levels)  # true division (see encode)
            torch.mul(blob[p:p + n].view(torch.int8).to(torch.float32), step, out=dst)
        else:
            raise ValueError(f"not a byte codec. Received: {spec}")
        off += size
        start += n
    return out
