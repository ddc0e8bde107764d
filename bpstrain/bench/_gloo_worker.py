"""One rank of a ``torch.distributed`` gloo all-reduce benchmark.

Run one process per rank (on loopback or inside emulated hosts)::

    python -m bpstrain.bench._gloo_worker --addr 127.0.0.1 --port 29500 \
        --rank 0 --world-size 2 --ifname lo --case 67108864:10:2 --case 4096:100:10

Rank 0 hosts the rendezvous store at ``--addr:--port``, so ``--addr`` must be
rank 0's address. Each ``--case BYTES:ITERS[:WARMUP]`` all-reduces a float32
tensor of BYTES bytes. The result is printed as one ``BENCH_RESULT`` JSON line
(see ``bpstrain.bench._report``).
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import datetime
import os
import sys

from bpstrain.bench import _report


def run(addr: str, port: int, rank: int, world_size: int, cases: list[_report.Case],
        timeout_s: float = 120.0) -> list[dict]:
    """All-reduces each case's tensor and returns per-iteration times.

    Args:
        addr: Address of rank 0 (rendezvous).
        port: Rendezvous port on rank 0.
        rank: This process's rank.
        world_size: Number of ranks.
        cases: Sizes and iteration counts.
        timeout_s: gloo operation timeout.

    Returns:
        ``[{"bytes": M, "times": [...]}, ...]`` in the order of ``cases``.

    Raises:
        RuntimeError: When the sum comes out wrong.
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        results = []
        for case in cases:
            tensor = torch.ones(case.nbytes // 4, dtype=torch.float32)
            dist.all_reduce(tensor)
            # Check one element per 4 KiB page: cheap, and catches a wrong reduction.
            if not bool((tensor[::1024] == world_size).all()):
                raise RuntimeError(f"gloo all_reduce of ones gave {tensor[0].item()}, "
                                   f"expected {world_size}. Received: bytes={case.nbytes}")
            # Refill so repeated in-place sums never overflow to inf.
            times = _report.time_calls(lambda: dist.all_reduce(tensor), case,
                                       reset=lambda: tensor.fill_(1.0))
            results.append({"bytes": case.nbytes, "times": times})
        dist.barrier()
        return results
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m bpstrain.bench._gloo_worker")
    parser.add_argument("--addr", required=True, help="rank 0's address")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--ifname", default=None,
                        help="network interface gloo binds to (sets GLOO_SOCKET_IFNAME)")
    parser.add_argument("--case", action="append", required=True,
                        help="BYTES:ITERS[:WARMUP], repeatable")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    # The parent sends SIGUSR1 before killing a stuck job: stacks land in stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.ifname:
        # gloo otherwise resolves the hostname, which points outside a namespace.
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    results = run(args.addr, args.port, args.rank, args.world_size,
                  _report.parse_cases(args.case), args.timeout)
    _report.emit("gloo", args.rank, args.world_size, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
