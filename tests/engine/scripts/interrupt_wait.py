"""Worker script: rank 0 blocks in a push_pull nobody else joins; the test sends SIGINT.

Prints BLOCKING before the wait and INTERRUPTED <seconds> when Ctrl-C arrives; rank 1
just waits for rank 0 to leave."""
import sys
import time

import numpy as np

import bpstrain.engine as bps

bps.init()
if bps.rank() == 0:
    print("BLOCKING", flush=True)
    try:
        bps.push_pull(np.ones(4, np.float32), name="only-rank-0")
    except KeyboardInterrupt:
        t = time.time()
        bps.shutdown()
        print(f"INTERRUPTED shutdown took {time.time() - t:.2f}s", flush=True)
        sys.exit(0)
else:
    time.sleep(60)
