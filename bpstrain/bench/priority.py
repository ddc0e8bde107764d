"""Priority scheduling, replayed: does the first layer's gradient come back sooner?

    python -m bpstrain.bench.priority [--workers 2] [--servers 1] [--rounds 5]

A backward pass produces gradients last layer first, while the next forward pass needs
the first layer first. Each worker replays that: it enqueues the gradients of a
VGG-like stack (small conv layers in front, big fully-connected layers at the back)
from the last layer to the first, with a little compute time between them, and records
when the first layer's sum is back and when all are back. The same job runs with
priority scheduling on and off (BPSTRAIN_PRIORITY), in one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

# Gradient sizes in float32 elements, front layer first (a scaled-down VGG-16 shape).
LAYERS = [1_728, 36_864, 73_728, 147_456, 294_912, 589_824, 589_824, 1_179_648,
          2_359_296, 2_359_296, 2_359_296, 2_359_296, 6_422_528, 4_194_304, 409_600]


def worker(rounds: int, compute_ms: float) -> None:
    """Runs inside the job: replays `rounds` backward passes, prints one JSON line."""
    import bpstrain.engine as bps

    bps.init()
    grads = [np.ones(n, np.float32) for n in LAYERS]
    outs = [np.empty_like(g) for g in grads]
    first, total = [], []
    for r in range(rounds + 1):  # round 0 declares everything and is not timed
        bps.barrier()
        start = time.perf_counter()
        handles = {}
        for i in reversed(range(len(LAYERS))):
            time.sleep(compute_ms / 1000)  # this layer's backward compute
            handles[i] = bps.push_pull_async(grads[i], name=f"layer{i}", priority=-i, out=outs[i])
        bps.synchronize(handles[0])
        t_first = time.perf_counter() - start
        for i in range(1, len(LAYERS)):
            bps.synchronize(handles[i])
        if r:
            first.append(t_first)
            total.append(time.perf_counter() - start)
    if bps.rank() == 0:
        print("PRIORITY_RESULT " + json.dumps({"first": first, "total": total}), flush=True)
    bps.shutdown()


def run_job(priority: bool, args) -> dict:
    env = {**os.environ, "BPSTRAIN_PRIORITY": "1" if priority else "0",
           "BYTEPS_PARTITION_BYTES": str(args.partition_bytes)}
    cmd = [sys.executable, "-m", "bpstrain.launch", "--workers", str(args.workers), "--servers",
           str(args.servers), "--", sys.executable, "-m", "bpstrain.bench.priority", "--worker",
           "--rounds", str(args.rounds), "--compute-ms", str(args.compute_ms)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env).stdout
    match = re.search(r"PRIORITY_RESULT (.*)", out)
    if not match:
        raise RuntimeError(f"the priority job printed no result:\n{out}")
    return json.loads(match.group(1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bpstrain.bench.priority")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compute-ms", type=float, default=2.0)
    parser.add_argument("--partition-bytes", type=int, default=1 << 20)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.rounds, args.compute_ms)
        return 0
    mb = sum(LAYERS) * 4 / 2**20
    print(f"backward replay: {len(LAYERS)} layers, {mb:.0f} MB of gradients, {args.workers} workers, "
          f"{args.servers} servers, loopback; median of {args.rounds} rounds")
    print(f"{'priority':9s} {'first layer ready':>18s} {'all ready':>10s}")
    rows = {}
    for priority in (False, True):
        res = run_job(priority, args)
        rows[priority] = (float(np.median(res["first"])), float(np.median(res["total"])))
        print(f"{'on' if priority else 'off':9s} {rows[priority][0] * 1e3:15.1f} ms {rows[priority][1] * 1e3:7.1f} ms")
    print(f"first layer ready {rows[False][0] / rows[True][0]:.2f}x sooner with priority scheduling")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
