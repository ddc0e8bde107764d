"""GpuHierarchy (NCCL reduce-scatter inside a host, push_pull across hosts, all-gather):
the same code path on CPU with a gloo local group, and on CUDA when each local rank has
its own GPU."""

import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "hier_gpu_worker.py"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers,local_size", [(2, 2), (4, 2)])
def test_hierarchical_gpu_path_sums_every_dtype(workers, local_size):
    r = subprocess.run(
        [sys.executable, "-m", "bpstrain.launch", "--workers", str(workers), "--servers", "1",
         "--local-size", str(local_size), "--", sys.executable, str(WORKER)],
        capture_output=True, text=True, timeout=170)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("HIER_OK") == workers, out
    assert f"hosts={workers // local_size} local={local_size}" in out
