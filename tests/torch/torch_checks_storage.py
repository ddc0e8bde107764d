"""The servers as embedding storage under a worker memory cap (see torch_check_worker.py):
each worker's address space is capped at what it uses now plus HEADROOM, and trains a
table ten times that size, which only the servers hold (rows created on first touch)."""

import resource

import numpy as np

import bpstrain.torch as bps
from bpstrain.embedding_table import EmbeddingTable

HEADROOM = 256 << 20


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def check_a_table_ten_times_the_worker_memory_cap_trains():
    r = bps.rank()
    width = 64
    rows = 10 * HEADROOM // (4 * width)  # 10x the memory this worker may still take
    table = EmbeddingTable("check.storage.big", rows, width, optimizer="adagrad", init_scale=0.01, seed=3)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + HEADROOM, hard))
    try:
        try:
            np.empty((rows, width), np.float32)  # the cap is real: the table cannot live here
            raise AssertionError("a table-sized array fit under the cap")
        except MemoryError:
            pass
        rng = np.random.default_rng(r)
        target = np.float32(0.5)
        losses = []
        for _ in range(30):
            ids = rng.zipf(1.2, 512) % rows  # skewed, hot rows repeat
            emb = table.pull(ids)
            losses.append(float(((emb - target) ** 2).mean()))
            table.push(ids, 2 * (emb - target) / ids.size, lr=0.5)
        assert losses[-1] < 0.5 * losses[0], losses  # the hot rows move toward the target
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
