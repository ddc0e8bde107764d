"""Worker for the launcher's SIGUSR1 test: joins, waits for SIGUSR1, then one push_pull.

Prints ``rank R ready`` once its handler is in place, ``rank R got USR1`` when it came
(or ``rank R no USR1`` after 30 s), and ``rank R sum S`` after the push_pull.
"""

import signal
import threading

import numpy as np

import bpstrain.engine as engine

got = threading.Event()
signal.signal(signal.SIGUSR1, lambda *_: got.set())
engine.init()
print(f"rank {engine.rank()} ready", flush=True)
print(f"rank {engine.rank()} {'got' if got.wait(30) else 'no'} USR1", flush=True)
out = engine.push_pull(np.ones(4, np.float32), name="usr1", average=False)
print(f"rank {engine.rank()} sum {out[0]:g}", flush=True)
engine.shutdown()
