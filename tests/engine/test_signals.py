"""Signals sent to a process reach Python's thread, never an engine thread.

A process-directed signal (a launcher's SIGUSR1 or SIGTERM, Ctrl-C's SIGINT) goes to any
thread that does not block it. Landing on an engine thread, CPython only sets a flag, and
a main thread blocked in a wait never runs its handler. Every thread the engine starts
must therefore block them."""

import os
import signal
import threading

import numpy as np
import pytest

from tests.engine.harness import InProcessCluster, push_pull

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("transport")]

ASYNC_SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2]


def blocked_signals(tid):
    """The signals thread ``tid`` of this process blocks (SigBlk of its status)."""
    with open(f"/proc/self/task/{tid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    return {sig for sig in signal.Signals if mask >> (sig - 1) & 1}


def threads():
    return set(int(t) for t in os.listdir("/proc/self/task"))


def test_every_engine_thread_blocks_the_asynchronous_signals():
    before = threads()
    with InProcessCluster(workers=1, servers=2, partition_bytes=64) as c:
        w = c.workers[0]
        # Data links, outboxes and the servers' engine threads start with the first round.
        out = push_pull(w, "t", np.arange(100, dtype=np.float32))
        np.testing.assert_array_equal(out, np.arange(100, dtype=np.float32))
        python_threads = {t.native_id for t in threading.enumerate()}
        engine = threads() - before - python_threads
        assert len(engine) >= 6, engine  # scheduler, servers, worker: not a vacuous check
        unblocked = {tid: sorted(set(ASYNC_SIGNALS) - blocked_signals(tid)) for tid in engine}
        assert not {tid: s for tid, s in unblocked.items() if s}, unblocked
    # Python's own thread still takes them.
    assert not set(ASYNC_SIGNALS) & blocked_signals(threading.main_thread().native_id)
