"""One worker of a bpstrain push_pull benchmark.

The cluster comes from BytePS's environment variables (``DMLC_ROLE=worker``,
``DMLC_NUM_WORKER``, ``DMLC_NUM_SERVER``, ``DMLC_PS_ROOT_URI``,
``DMLC_PS_ROOT_PORT``, ``DMLC_WORKER_ID``, ``BYTEPS_LOCAL_RANK``,
``BYTEPS_LOCAL_SIZE``); scheduler and servers must be running::

    python -m bpstrain.bench._bps_worker --case 67108864:10:2 --case 4096:100:10

Each ``--case BYTES:ITERS[:WARMUP]`` push_pulls (sum, no averaging) a float32
tensor of BYTES bytes. The result is printed as one ``BENCH_RESULT`` JSON line
(see ``bpstrain.bench._report``).
"""

from __future__ import annotations

import sys

import numpy as np

from bpstrain.bench import _report


def run(cases: list[_report.Case], partition_bytes: int | None = None) -> tuple[int, int, list[dict]]:
    """Push_pulls each case's tensor and returns per-iteration times.

    Args:
        cases: Sizes and iteration counts.
        partition_bytes: Overrides the engine's partition size when given.

    Returns:
        ``(rank, size, [{"bytes": M, "times": [...]}, ...])``.

    Raises:
        RuntimeError: When the sum comes out wrong.
    """
    from bpstrain import engine

    engine.init({"partition_bytes": partition_bytes} if partition_bytes else None)
    try:
        rank, size = engine.rank(), engine.size()
        results = []
        for case in cases:
            name = f"bpstrain.bench.{case.nbytes}"
            shape = (case.nbytes // 4,)
            engine.declare(name, shape, "float32")
            data = np.ones(shape, dtype=np.float32)
            out = np.empty_like(data)
            engine.push_pull(data, name, average=False, out=out)
            if not bool((out[::1024] == size).all()):
                raise RuntimeError(f"push_pull of ones gave {out[0]}, expected {size}. "
                                   f"Received: bytes={case.nbytes}")
            # Input is never modified (out= is separate), so no refill is needed.
            times = _report.time_calls(
                lambda: engine.push_pull(data, name, average=False, out=out), case)
            results.append({"bytes": case.nbytes, "times": times})
        engine.barrier()
        return rank, size, results
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    return _report.worker_main("python -m bpstrain.bench._bps_worker", run, argv)


if __name__ == "__main__":
    sys.exit(main())
