"""Worker for the end-to-end launcher tests: one push_pull through the real engine.

Exits 1 when the sum is wrong; E2E_FAIL_RANK=r makes rank r exit 9 right after init.
"""

import os
import sys

import numpy as np

import bpstrain.engine as engine

engine.init()
rank, size = engine.rank(), engine.size()
if os.environ.get("E2E_FAIL_RANK") == str(rank):
    print("failing on purpose", flush=True)
    sys.exit(9)
out = engine.push_pull(np.full(1000, rank + 1, dtype=np.float32), name="grad", average=False)
expected = size * (size + 1) / 2
print(f"rank {rank} of {size}: sum {out[0]:g} expected {expected:g}", flush=True)
engine.shutdown()
sys.exit(0 if np.all(out == expected) else 1)
