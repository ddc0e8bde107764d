"""One worker of the fuzzer's live job (see ``bpstrain.bench.fuzz``): ``rounds`` sums of
a small tensor whose exact result it checks every round, then a clean shutdown. Exits 3
on a wrong sum, so the fuzzer can tell "a forged push got in" from "the job failed"."""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--elems", type=int, default=1024)
    parser.add_argument("--until", default="", help="then go on until this file exists")
    parser.add_argument("--ready", default="", help="create this file after the first round")
    args = parser.parse_args()
    from bpstrain import engine

    engine.init()
    rank, size = engine.rank(), engine.size()
    base = np.arange(args.elems, dtype=np.float32)
    out = np.empty_like(base)
    want_factor = size * (size + 1) / 2
    import os

    def more(r: int) -> bool:
        if r < args.rounds or not args.until:
            return r < args.rounds
        # Every rank must run the same number of rounds: rank 0 decides, the others
        # learn it through a broadcast of its decision every 100 rounds.
        if r % 100:
            return True
        flag = np.array([0.0 if args.until and os.path.exists(args.until) else 1.0], np.float32)
        go = engine.broadcast(flag, root_rank=0, name="fuzz.more")
        return bool(go[0])

    r = 0
    try:
        while more(r):
            # Every rank contributes (rank + 1) * base, so the sum is known exactly.
            engine.push_pull((rank + 1) * base, "fuzz.grad", average=False, out=out)
            if not np.array_equal(out, want_factor * base):
                print(f"fuzz worker {rank}: round {r} has a wrong sum", file=sys.stderr, flush=True)
                return 3
            if r == 0 and args.ready:
                open(f"{args.ready}.{rank}", "w").close()
            r += 1
    finally:
        engine.shutdown()
    print(f"fuzz worker {rank}: {r} rounds correct", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
