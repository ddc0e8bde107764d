"""One worker of the hierarchical benchmark: push_pull timings plus bytes sent to servers.

Like ``bpstrain.bench._bps_worker`` (same ``--case`` flags, same ``BENCH_RESULT``
line), but every rank contributes ``rank + 1`` so a wrong reduction inside a host
shows up, the whole result is checked, and each result also carries the bytes
this process pushed to and pulled from the servers per call
(``engine.stats()`` deltas)::

    {"bytes": M, "times": [...], "bytes_pushed": P, "bytes_pulled": Q}

Flat or hierarchical is chosen by the environment (``BPSTRAIN_HIERARCHICAL``).
"""

from __future__ import annotations

import sys

import numpy as np

from bpstrain.bench import _report


def run(cases: list[_report.Case],
        partition_bytes: int | None = None) -> tuple[int, int, list[dict]]:
    """Push_pulls each case's tensor; returns times and per-call byte counts.

    Args:
        cases: Sizes and iteration counts.
        partition_bytes: Overrides the engine's partition size when given.

    Returns:
        ``(rank, size, [{"bytes", "times", "bytes_pushed", "bytes_pulled"}, ...])``.

    Raises:
        RuntimeError: When the sum comes out wrong.
    """
    from bpstrain import engine

    engine.init({"partition_bytes": partition_bytes} if partition_bytes else None)
    try:
        rank, size = engine.rank(), engine.size()
        expected = np.float32(size * (size + 1) // 2)  # sum of rank + 1; exact in float32
        results = []
        for case in cases:
            name = f"bpstrain.bench.hier.{case.nbytes}"
            shape = (case.nbytes // 4,)
            engine.declare(name, shape, "float32")
            data = np.full(shape, rank + 1, dtype=np.float32)
            out = np.empty_like(data)

            def call():
                engine.push_pull(data, name, average=False, out=out)

            call()
            _check(out, expected, case.nbytes)
            before = engine.stats()
            times = _report.time_calls(call, case)
            after = engine.stats()
            _check(out, expected, case.nbytes)  # the last timed call, too
            calls = case.warmup + case.iters
            results.append({
                "bytes": case.nbytes, "times": times,
                "bytes_pushed": (after["bytes_pushed"] - before["bytes_pushed"]) // calls,
                "bytes_pulled": (after["bytes_pulled"] - before["bytes_pulled"]) // calls,
            })
        engine.barrier()
        return rank, size, results
    finally:
        engine.shutdown()


def _check(out: np.ndarray, expected: np.float32, nbytes: int) -> None:
    if not np.array_equal(out, np.broadcast_to(expected, out.shape)):
        wrong = int(np.flatnonzero(out != expected)[0])
        raise RuntimeError(f"push_pull sum is wrong at element {wrong}: expected {expected}. "
                           f"Received: {out[wrong]} (bytes={nbytes})")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    return _report.worker_main("python -m bpstrain.bench._hier_worker", run, argv)


if __name__ == "__main__":
    sys.exit(main())
