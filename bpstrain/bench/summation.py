"""Server summation kernel vs numpy, one thread each, same machine, same run.

    python -m bpstrain.bench.summation [--mbytes 64] [--repeat 20]

Prints GB/s of ``dst += src`` (bytes of dst+src read plus dst written, per second) for
the engine's kernels (the ones the servers run, AVX-512/AVX2 when the CPU has them) and
for ``np.add(a, b, out=a)``, and their ratio. For float16/bfloat16 the engine figure is
the server's real per-push step, ``acc_fp32 += src`` (fp32 accumulation, more bytes).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bpstrain import _core

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None


def _best_time(fn, repeat):
    fn()  # warm-up: page faults, caches
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(dtype: str, nbytes: int, repeat: int):
    """Returns (engine GB/s, numpy GB/s) for one dtype."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    n = nbytes // np.dtype(np_dtype).itemsize
    a = np.ones(n, np_dtype)
    b = np.ones(n, np_dtype)
    raw_a = a.view(np.uint16) if dtype == "bfloat16" else a
    raw_b = b.view(np.uint16) if dtype == "bfloat16" else b
    moved = 3 * nbytes / 1e9
    if dtype in ("float16", "bfloat16"):
        # A server accumulates half-precision pushes into a float32 buffer.
        acc = np.ones(n, np.float32)
        engine = (nbytes + 2 * acc.nbytes) / 1e9 / _best_time(
            lambda: _core.accumulate(acc, raw_b, dtype), repeat)
    else:
        engine = moved / _best_time(lambda: _core.sum_into(raw_a, raw_b, dtype), repeat)
    numpy = moved / _best_time(lambda: np.add(a, b, out=a), repeat)
    return engine, numpy


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bpstrain.bench.summation")
    parser.add_argument("--mbytes", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64", "float16", "bfloat16", "int32"])
    args = parser.parse_args(argv)
    print(f"dst += src on {args.mbytes} MB, one thread each, best of {args.repeat}")
    print(f"{'dtype':9s} {'engine GB/s':>12s} {'numpy GB/s':>11s} {'engine/numpy':>13s}")
    for dtype in args.dtypes:
        if dtype == "bfloat16" and ml_dtypes is None:
            continue
        engine, numpy = measure(dtype, args.mbytes << 20, args.repeat)
        print(f"{dtype:9s} {engine:12.2f} {numpy:11.2f} {engine / numpy:12.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
