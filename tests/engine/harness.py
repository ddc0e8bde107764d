"""In-process harness: a scheduler, servers and N workers of the real engine, all in
this process, over loopback TCP or the in-process transport (no sockets), so engine
unit tests run in milliseconds. Tests that take the ``transport`` fixture
(tests/engine/conftest.py) run once per transport, the way gloo's tests do.

    with InProcessCluster(workers=2, servers=1) as c:
        results = c.run_all(lambda rank, w: ...)   # one thread per worker
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List

import numpy as np

from bpstrain import _core

# The transport of clusters that do not name one; the ``transport`` fixture sets it.
DEFAULT_TRANSPORT = "tcp"


class InProcessCluster:
    """Scheduler + servers + workers in this process; torn down on exit."""

    def __init__(self, workers=2, servers=1, secret="", local_size=1, worker_hosts=None,
                 server_hosts=None, mixed_mode=True, assign_ranks=False, transport=None,
                 extra_workers=0, before_ready=None, peer_timeout=10, handler=None, fault_tolerance=False,
                 max_workers=0, **worker_kwargs):
        """``workers`` processes on ``workers // local_size`` hosts (BytePS's
        DMLC_NUM_WORKER); ``worker_hosts`` / ``server_hosts`` name each node's host
        (BPSTRAIN_HOST_ID) for mixed-mode placement, default all unnamed; with
        ``assign_ranks`` the scheduler numbers workers by arrival (no DMLC_WORKER_ID).
        ``extra_workers`` more workers are expected that the test plays itself
        (``before_ready(cluster)`` connects them, through ``connect_raw``). ``handler``
        is a factory of Python server handlers (None: the servers sum).
        ``fault_tolerance`` turns comm.fault_tolerance on at the scheduler and workers;
        ``max_workers`` is the scheduler's comm.max_workers (scale-up)."""
        self.transport = transport = transport or DEFAULT_TRANSPORT
        self.secret = secret
        self.scheduler = _core.Scheduler((workers + extra_workers) // local_size, servers, host="127.0.0.1",
                                         port=0, rendezvous_timeout=20, peer_timeout=peer_timeout,
                                         secret=secret, mixed_mode=mixed_mode, transport=transport,
                                         fault_tolerance=fault_tolerance, max_workers=max_workers)
        self.scheduler.start()
        port = self.scheduler_port = self.scheduler.port
        server_hosts = server_hosts or [""] * servers
        self.servers = [
            _core.Server("127.0.0.1", port, listen_host="127.0.0.1", engine_threads=2, numa="off",
                         rendezvous_timeout=20, secret=secret, server_id=j, host_id=server_hosts[j],
                         transport=transport, handler=handler)
            for j in range(servers)
        ]
        for s in self.servers:
            s.start()
        worker_kwargs.setdefault("numa", "off")
        worker_kwargs.setdefault("fault_tolerance", fault_tolerance)
        self.workers = [
            _core.Worker("127.0.0.1", port, rank_hint=-1 if assign_ranks else i,
                         rendezvous_timeout=20, secret=secret,
                         local_rank=i % local_size, local_size=local_size,
                         host_id=worker_hosts[i] if worker_hosts else "", transport=transport,
                         **worker_kwargs)
            for i in range(workers)
        ]
        for w in self.workers:
            w.start()
        if before_ready:
            before_ready(self)
        for w in self.workers:
            while not w.wait_ready(0.1):
                pass

    def run_all(self, fn: Callable[[int, "_core.Worker"], object]) -> List[object]:
        """Runs fn(rank, worker) on one thread per worker; returns results by rank."""
        with ThreadPoolExecutor(len(self.workers)) as pool:
            futures = [pool.submit(fn, w.rank, w) for w in self.workers]
            return [f.result(timeout=60) for f in futures]

    def connect_raw(self, port=None, handshake=False, **kwargs):
        """A raw frame link to the scheduler (or to ``port``) over this cluster's transport;
        with ``handshake=True`` it first passes the secure handshake (with this cluster's
        secret, or ``key=``/``identity=`` for a server's data port)."""
        if handshake:
            kwargs.setdefault("secret", self.secret)
        return _core.connect_raw(self.transport, "127.0.0.1", port or self.scheduler_port,
                                 handshake=handshake, **kwargs)

    def close(self):
        for w in self.workers:
            w.shutdown()
        for s in self.servers:
            s.wait(5)
            s.stop()
        self.scheduler.wait(5)
        self.scheduler.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait(worker, handle, timeout=30.0):
    """Blocks until the handle completes (raises its error)."""
    waited = 0.0
    while not worker.wait(handle, 0.05):
        waited += 0.05
        if waited > timeout:
            raise TimeoutError(worker.describe(handle))


def push_pull(worker, name, array, op=0, root=0, priority=0, out=None, participants=0):
    """Blocking push_pull on one in-process worker; returns the output array."""
    out = np.empty_like(array) if out is None else out
    dtype = array.dtype.name
    if dtype == "bfloat16":  # ml_dtypes arrays do not export a buffer format
        array, out_view = array.view(np.uint16), out.view(np.uint16)
    else:
        out_view = out
    h = worker.enqueue(name, dtype, list(array.shape), array, out_view, op, root, priority,
                       participants=participants)
    wait(worker, h)
    return out
