"""How benchmark workers time their iterations and hand results to the parent.

A worker prints exactly one line ``BENCH_RESULT {json}`` on stdout; anything
else it (or the engine) prints is ignored by ``parse_result``. The JSON is::

    {"system": "gloo"|"bpstrain", "rank": r, "size": n,
     "results": [{"bytes": M, "times": [seconds, ...]}, ...]}
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence

MARKER = "BENCH_RESULT "


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured tensor size: ``warmup`` untimed then ``iters`` timed calls."""

    nbytes: int
    iters: int
    warmup: int = 1


def parse_cases(specs: Sequence[str]) -> list[Case]:
    """Parses ``BYTES:ITERS[:WARMUP]`` strings (the workers' ``--case`` flags)."""
    cases = []
    for spec in specs:
        parts = spec.split(":")
        if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"Expected BYTES:ITERS[:WARMUP] with integers. Received: {spec!r}")
        nbytes, iters, *rest = (int(p) for p in parts)
        if nbytes < 4 or nbytes % 4 or iters < 1:
            raise ValueError("Expected a positive multiple of 4 bytes (float32) and "
                             f"iters >= 1. Received: {spec!r}")
        cases.append(Case(nbytes, iters, rest[0] if rest else 1))
    return cases


def format_case(case: Case) -> str:
    """Inverse of ``parse_cases`` for one case."""
    return f"{case.nbytes}:{case.iters}:{case.warmup}"


def time_calls(fn: Callable[[], object], case: Case,
               reset: Callable[[], object] | None = None) -> list[float]:
    """Runs ``fn`` ``case.warmup`` times untimed, then returns ``case.iters`` timings.

    Args:
        fn: The collective call to time.
        case: Iteration counts.
        reset: Optional untimed call before each ``fn`` (e.g. refill the input).
    """
    times = []
    for i in range(case.warmup + case.iters):
        if reset is not None:
            reset()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i >= case.warmup:
            times.append(elapsed)
    return times


def emit(system: str, rank: int, size: int, results: list[dict]) -> None:
    """Prints the single result line the parent looks for."""
    payload = {"system": system, "rank": rank, "size": size, "results": results}
    print(MARKER + json.dumps(payload), flush=True)


def parse_result(stdout: str) -> dict:
    """Returns the JSON payload of the last ``BENCH_RESULT`` line in ``stdout``.

    Raises:
        ValueError: When the output has no such line.
    """
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    tail = stdout[-500:]
    raise ValueError(f"Expected a '{MARKER.strip()} {{json}}' line in the worker output. "
                     f"Received: ...{tail!r}")


def worker_main(prog: str, run: Callable, argv: Sequence[str] | None = None) -> int:
    """Command line shared by the bpstrain benchmark workers.

    Parses ``--case BYTES:ITERS[:WARMUP]`` (repeatable) and ``--partition-bytes``, calls
    ``run(cases, partition_bytes) -> (rank, size, results)`` and prints the
    ``BENCH_RESULT`` line.
    """
    import argparse
    import faulthandler
    import signal

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--case", action="append", required=True,
                        help="BYTES:ITERS[:WARMUP], repeatable")
    parser.add_argument("--partition-bytes", type=int, default=None)
    args = parser.parse_args(argv)
    # The parent sends SIGUSR1 before killing a stuck job: stacks land in stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rank, size, results = run(parse_cases(args.case), args.partition_bytes)
    emit("bpstrain", rank, size, results)
    return 0
