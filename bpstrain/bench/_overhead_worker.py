"""One worker of the per-operation overhead benchmark (see ``bpstrain.bench.overhead``).

Three loops over the same small float32 sum, timed in alternating blocks in this one
process so that every path sees the same machine load::

    raw binding       worker.enqueue(...) + worker.wait(h, ...) on numpy arrays
    bpstrain.engine   bpstrain.engine.push_pull(array, name, average=False, out=out)
    bpstrain.torch    bpstrain.torch.push_pull(tensor, average=False, name=name)

Prints one ``BENCH_RESULT`` line whose results hold, per path, the seconds per
operation of every block.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
import time

import numpy as np

from bpstrain.bench import _report

PATHS = ("raw binding", "bpstrain.engine", "bpstrain.torch")


def run(nbytes: int, ops: int, blocks: int, warmup: int) -> tuple[int, int, list[dict]]:
    """Times ``blocks`` blocks of ``ops`` operations per path; returns the payload parts."""
    import torch

    import bpstrain.torch as bps
    from bpstrain import engine

    bps.init()
    try:
        worker, size = engine.core_worker(), engine.size()
        if worker is None:
            raise RuntimeError("the overhead benchmark needs a launched job (DMLC_ROLE=worker). "
                               "Received: a standalone process")
        n = nbytes // 4
        array, out, tensor, shape = np.ones(n, np.float32), np.empty(n, np.float32), torch.ones(n), [n]

        def raw(count: int) -> None:
            for _ in range(count):
                h = worker.enqueue("overhead.raw", "float32", shape, array, out, engine.Op.SUM)
                while not worker.wait(h, 0.1):
                    pass

        def facade(count: int) -> None:
            for _ in range(count):
                engine.push_pull(array, "overhead.engine", average=False, out=out)

        def adapter(count: int) -> None:
            for _ in range(count):
                result = bps.push_pull(tensor, average=False, name="overhead.torch")
            if not bool((result == size).all()):
                raise RuntimeError(f"push_pull of ones gave {result[0]}, expected {size}")

        loops = dict(zip(PATHS, (raw, facade, adapter)))
        for loop in loops.values():
            loop(warmup)
        times = {path: [] for path in PATHS}
        for _ in range(blocks):
            for path, loop in loops.items():
                engine.barrier()  # every rank starts the block together
                start = time.perf_counter()
                loop(ops)
                times[path].append((time.perf_counter() - start) / ops)
        if not bool((out == size).all()):
            raise RuntimeError(f"the raw sum of ones gave {out[0]}, expected {size}")
        engine.barrier()
        return engine.rank(), size, [{"path": p, "bytes": nbytes, "times": times[p]} for p in PATHS]
    finally:
        bps.shutdown()


def main(argv: list[str] | None = None) -> int:
    """``python -m bpstrain.bench._overhead_worker --bytes B --ops N --blocks K --warmup W``."""
    parser = argparse.ArgumentParser(prog="python -m bpstrain.bench._overhead_worker")
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--ops", type=int, required=True)
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks before a kill
    rank, size, results = run(args.bytes, args.ops, args.blocks, args.warmup)
    _report.emit("bpstrain", rank, size, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
