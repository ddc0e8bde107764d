"""Worker for the killed-task test: joins the job, says where it runs, then holds.

Prints ``rank R launcher P`` (P = the pid of the launcher task that started it) and sleeps
up to HOLD_S seconds (default 60) before its push_pull, so the test can kill a task while
every process of the job is up; a requeued run (``SLURM_RESTART_COUNT`` > 0) does not hold.
"""

import os
import time

import numpy as np

import bpstrain.engine as engine

engine.init()
print(f"rank {engine.rank()} launcher {os.getppid()} pid {os.getpid()}", flush=True)
if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    time.sleep(float(os.environ.get("HOLD_S", "60")))
out = engine.push_pull(np.ones(10, dtype=np.float32), name="grad", average=False)
print(f"rank {engine.rank()} done: sum {out[0]:g}", flush=True)
engine.shutdown()
