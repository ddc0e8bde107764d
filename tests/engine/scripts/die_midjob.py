"""Worker script: loops push_pull; the rank named in DIE_RANK SIGKILLs itself.

Survivors print PEER_ERROR <seconds since last success> <message> and exit 17.
With DIE_RANK=-1 nobody dies (the test kills a server from outside)."""
import os
import signal
import sys
import time

import numpy as np

import bpstrain.engine as bps
from bpstrain.errors import BpsError

bps.init()
die = int(os.environ.get("DIE_RANK", "-1"))
print("READY", flush=True)
last_ok = time.time()
try:
    for i in range(100000):
        if i == 5 and bps.rank() == die:
            os.kill(os.getpid(), signal.SIGKILL)
        bps.push_pull(np.ones(1000, np.float32), name="g")
        last_ok = time.time()
        time.sleep(0.01)
except BpsError as exc:
    print(f"PEER_ERROR {time.time() - last_ok:.1f} {type(exc).__name__}: {exc}", flush=True)
    sys.exit(17)
