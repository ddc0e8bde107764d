"""Hugging Face Accelerate over the torch.distributed backend "bpstrain".

Accelerate learns about a distributed run from torchrun's variables, so torchrun starts
the two workers; the scheduler and the server are started by role, as BytePS's are.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="Accelerate is optional: pip install 'bpstrain[accelerate]'")

REPO = Path(__file__).resolve().parents[2]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_accelerator_training_loop_on_2_torchrun_workers(tmp_path):
    common = {k: v for k, v in os.environ.items()
              if not k.startswith(("DMLC_", "BYTEPS_", "ACCELERATE_"))}
    common.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", BPSTRAIN_OP_TIMEOUT="30",
                  DMLC_NUM_WORKER="1", BYTEPS_LOCAL_SIZE="2", DMLC_NUM_SERVER="1",
                  DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(_free_port()))
    roles = [subprocess.Popen([sys.executable, "-m", "bpstrain.launch"], cwd=REPO,
                              env={**common, "DMLC_ROLE": role}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for role in ("scheduler", "server")]
    try:
        workers = {k: v for k, v in common.items() if k not in ("BYTEPS_LOCAL_SIZE", "DMLC_NUM_WORKER")}
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(_free_port()), str(Path(__file__).parent / "accelerate_torchrun_worker.py")],
            cwd=REPO, env={**workers, "DMLC_ROLE": "worker", "RESULT_DIR": str(tmp_path)},
            capture_output=True, text=True, timeout=200)
    finally:
        for p in roles:
            try:
                p.wait(timeout=30)  # they exit once the workers have left
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    results = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("*.json"))]
    assert proc.returncode == 0 and len(results) == 2, (proc.stdout + proc.stderr)[-3000:]
    for rank, r in enumerate(results):
        assert (r["rank"], r["bps_rank"], r["size"], r["backend"]) == (rank, rank, 2, "bpstrain"), r
        assert r["multi_cpu"] and r["ddp"] and r["moved"], r
        assert r["max_diff"] < 1e-5, r  # the same weights as one process on both batches
        assert len(r["losses"]) == 3 and all(len(step) == 2 for step in r["losses"]), r
    assert results[0]["losses"] == results[1]["losses"]  # gather: every rank sees both
