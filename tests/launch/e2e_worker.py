"""Worker for the end-to-end launcher tests: one push_pull through the real engine.

Exits 1 when the sum is wrong; E2E_FAIL_RANK=r makes rank r exit 9 right after init;
E2E_RAISE_RANK=r makes rank r raise ZeroDivisionError; E2E_JOBS=n runs n jobs one after the
other in the same processes.
"""

import os
import sys

import numpy as np

import bpstrain.engine as engine

ok = True
# E2E_JOBS=n: init() and shutdown() n times in this process (as Horovod allows).
for job in range(int(os.environ.get("E2E_JOBS", "1"))):
    engine.init()
    rank, size = engine.rank(), engine.size()
    if os.environ.get("E2E_FAIL_RANK") == str(rank):
        print("failing on purpose", flush=True)
        sys.exit(9)
    if os.environ.get("E2E_RAISE_RANK") == str(rank):
        raise ZeroDivisionError("bad batch")
    out = engine.push_pull(np.full(1000, rank + 1, dtype=np.float32), name="grad", average=False)
    expected = size * (size + 1) / 2
    print(("" if job == 0 else f"job {job}: ") + f"rank {rank} of {size}: sum {out[0]:g} "
          f"expected {expected:g}", flush=True)
    engine.shutdown()
    ok = ok and bool(np.all(out == expected))
sys.exit(0 if ok else 1)
