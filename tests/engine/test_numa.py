"""NUMA/CPU affinity of engine threads: parsed from config, applied, readable back."""

import os
from pathlib import Path

import numpy as np
import pytest

from bpstrain import _core
from bpstrain.errors import ConfigError
from tests.engine.harness import InProcessCluster, push_pull

pytestmark = pytest.mark.timeout(60)


def engine_thread_cpus():
    """{thread name: Cpus_allowed_list} for this process's bpstrain engine threads."""
    out = {}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except OSError:
            continue
        if name.startswith("bps-"):
            allowed = [l.split(":", 1)[1].strip() for l in status.splitlines() if l.startswith("Cpus_allowed_list")]
            out.setdefault(name, set()).add(allowed[0])
    return out


def test_cpu_list_parsing():
    assert _core.resolve_cpus("cpus:0-2,5") == [0, 1, 2, 5]
    assert _core.resolve_cpus("off") == []
    nodes = _core.numa_node_count()
    if nodes <= 1:
        assert _core.resolve_cpus("auto") == []  # single node: leave threads alone
    for bad in ("cpus:3-1", "node:999", "banana", "cpus:x", "cpus:1x", "cpus:0-70000"):
        with pytest.raises(ConfigError):
            _core.resolve_cpus(bad)


def test_engine_threads_are_pinned_as_configured():
    with InProcessCluster(1, 1, numa="cpus:0") as c:
        push_pull(c.workers[0], "x", np.ones(4, np.float32))
        cpus = engine_thread_cpus()
    worker_threads = {k: v for k, v in cpus.items() if k.startswith(("bps-send", "bps-recv"))}
    assert worker_threads, cpus
    assert all(v == {"0"} for v in worker_threads.values()), worker_threads
