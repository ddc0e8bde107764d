"""Size parsing and the communication lower bounds the benchmarks compare against.

With per-host link bandwidth B (bytes/s, each direction), n workers, k servers
(each on its own host) and a tensor of M bytes:

* parameter server: every worker sends and receives M, every server receives
  and sends n*M/k, so one push_pull needs at least ``max(M/B, n*M/(k*B))``;
* ring all-reduce: every rank sends and receives ``2(n-1)/n * M``, so at least
  ``2(n-1)/n * M/B``;
* mixed mode (a server on each worker host plus k dedicated ones, see
  :func:`mixed_bound_s`): ``2n(n-1)/(n(n+k)-2k) * M/B``.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Parses ``"4M"``, ``"64MB"``, ``"4KiB"``, ``"1.5G"`` or ``"4096"`` to bytes.

    Suffixes are binary: K = 1024, M = 1024**2, G = 1024**3.

    Raises:
        ValueError: On anything else, or a size below one byte.
    """
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(text)
        if not match:
            raise ValueError("Expected a size like 4096, 4K, 64M or 1G. "
                             f"Received: {text!r}")
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value < 1:
        raise ValueError(f"Expected a size of at least 1 byte. Received: {text!r}")
    return value


def format_size(nbytes: int) -> str:
    """Short binary size: 4096 -> ``"4K"``, 67108864 -> ``"64M"``, 1000 -> ``"1000"``."""
    for suffix in ("G", "M", "K"):
        unit = _UNITS[suffix]
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    for suffix in ("G", "M", "K"):
        if nbytes >= _UNITS[suffix]:
            return f"{nbytes / _UNITS[suffix]:.1f}{suffix}"
    return str(nbytes)


def link_bytes_per_s(rate_mbit: float) -> float:
    """Bytes per second of a link of ``rate_mbit`` Mbit/s (decimal, as tc uses)."""
    return rate_mbit * 1e6 / 8


def ps_bound_s(nbytes: int, workers: int, servers: int, link_bps: float) -> float:
    """Lower bound on one parameter-server push_pull: ``max(M/B, n*M/(k*B))``."""
    _check(nbytes, workers, link_bps)
    if servers < 1:
        raise ValueError(f"Expected servers >= 1. Received: servers={servers}")
    return max(nbytes / link_bps, workers * nbytes / (servers * link_bps))


def mixed_bound_s(nbytes: int, workers: int, dedicated: int, link_bps: float) -> float:
    """Lower bound with a server on every worker host plus ``dedicated`` server hosts.

    BytePS's mixed mode puts 2k(n-1)/(n(n+k)-2k) of the bytes on the k dedicated
    servers; the slowest link then carries 2n(n-1)/(n(n+k)-2k) * M: the ring's
    2(n-1)/n * M at k = 0 and M at k = n. With k >= n the co-located servers get
    nothing and the plain parameter-server bound applies.
    """
    _check(nbytes, workers, link_bps)
    n, k = workers, dedicated
    if k < 0:
        raise ValueError(f"Expected dedicated >= 0. Received: dedicated={dedicated}")
    if n == 1:
        return 0.0 if k == 0 else ps_bound_s(nbytes, n, k, link_bps)
    if k >= n:
        return ps_bound_s(nbytes, n, k, link_bps)
    return 2 * n * (n - 1) / (n * (n + k) - 2 * k) * nbytes / link_bps


def ring_bound_s(nbytes: int, workers: int, link_bps: float) -> float:
    """Lower bound on one ring all-reduce: ``2(n-1)/n * M/B`` (0 for one rank)."""
    _check(nbytes, workers, link_bps)
    return 2 * (workers - 1) / workers * nbytes / link_bps


def _check(nbytes: int, workers: int, link_bps: float) -> None:
    if nbytes < 0 or workers < 1 or link_bps <= 0:
        raise ValueError("Expected nbytes >= 0, workers >= 1 and a positive link rate. "
                         f"Received: nbytes={nbytes}, workers={workers}, link={link_bps}")
