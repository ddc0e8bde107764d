"""Benchmark result rows, their reduction from per-rank timings, and the table.

Columns of the printed table:

* ``part``: the partition size set for the run, ``auto`` when the engine chose;
* ``time``: median over iterations of the slowest rank's time for that iteration;
* ``algbw``: M / time, in Gbit/s;
* ``algbw/B``: algbw as a fraction of the per-host link rate (emulated only);
* ``bound``: the lower bound of ``bpstrain.bench.bounds`` for that system;
* ``of bound``: bound / time (1.0 = as fast as the links allow);
* ``vs gloo``: gloo time / time for the same size and workers (>1 = faster than gloo).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

from bpstrain.bench.bounds import format_size


@dataclasses.dataclass
class Row:
    """One measured (system, workers, servers, size, partition) combination."""

    system: str
    workers: int
    servers: int | None
    nbytes: int
    time_s: float
    partition_bytes: int | None = None
    bound_s: float | None = None
    link_bps: float | None = None
    gloo_time_s: float | None = None

    @property
    def algbw_bps(self) -> float:
        """Algorithm bandwidth in bytes/s."""
        return self.nbytes / self.time_s if self.time_s > 0 else float("inf")

    def as_dict(self) -> dict:
        """Plain dict with the derived columns, for ``--json`` output."""
        data = dataclasses.asdict(self)
        data["algbw_bps"] = self.algbw_bps
        data["of_bound"] = self.bound_s / self.time_s if self.bound_s else None
        data["vs_gloo"] = self.gloo_time_s / self.time_s if self.gloo_time_s else None
        return data


def reduce_times(payloads: Sequence[dict]) -> dict[int, float]:
    """Median over iterations of the per-iteration maximum across ranks.

    Args:
        payloads: Parsed ``BENCH_RESULT`` payloads, one per rank of one job.

    Returns:
        ``{nbytes: seconds}``.

    Raises:
        ValueError: When ranks measured different cases.
    """
    by_size: dict[int, list[list[float]]] = {}
    for payload in payloads:
        for result in payload["results"]:
            by_size.setdefault(result["bytes"], []).append(result["times"])
    out = {}
    for nbytes, per_rank in by_size.items():
        if len(per_rank) != len(payloads) or len({len(t) for t in per_rank}) != 1:
            raise ValueError(f"Expected every rank to time {nbytes} bytes equally often. "
                             f"Received: {[len(t) for t in per_rank]} iterations "
                             f"from {len(payloads)} ranks")
        slowest = [max(step) for step in zip(*per_rank)]
        out[nbytes] = statistics.median(slowest)
    return out


def attach_gloo(rows: list[Row]) -> None:
    """Fills ``gloo_time_s`` of every row from the gloo row of equal workers and size."""
    gloo = {(r.workers, r.nbytes): r.time_s for r in rows if r.system == "gloo"}
    for row in rows:
        row.gloo_time_s = gloo.get((row.workers, row.nbytes))


def format_time(seconds: float) -> str:
    """``0.000123`` -> ``"123 us"``, ``0.0456`` -> ``"45.6 ms"``, ``2.5`` -> ``"2.50 s"``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


_HEADERS = ("system", "n", "k", "size", "part", "time", "algbw Gb/s",
            "algbw/B", "bound", "of bound", "vs gloo")


def format_table(rows: Sequence[Row]) -> str:
    """Renders rows as an aligned plain-text table (one header, one line per row)."""
    lines = [_HEADERS]
    for r in rows:
        lines.append((
            r.system,
            str(r.workers),
            "-" if r.servers is None else str(r.servers),
            format_size(r.nbytes),
            format_size(r.partition_bytes) if r.partition_bytes
            else "-" if r.system == "gloo" else "auto",
            format_time(r.time_s),
            f"{r.algbw_bps * 8 / 1e9:.3f}",
            "-" if r.link_bps is None else f"{r.algbw_bps / r.link_bps:.2f}",
            "-" if r.bound_s is None else format_time(r.bound_s),
            "-" if r.bound_s is None else f"{r.bound_s / r.time_s:.2f}",
            "-" if r.gloo_time_s is None else f"{r.gloo_time_s / r.time_s:.2f}x",
        ))
    return render(lines[0], lines[1:])


def render(headers: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """Aligns cells under ``headers``: first column left, the others right, a rule below."""
    lines = [tuple(headers), *(tuple(line) for line in lines)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    text = ["  ".join(cell.rjust(w) if i else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
            for line in lines]
    text.insert(1, "-" * len(text[0]))
    return "\n".join(text)
