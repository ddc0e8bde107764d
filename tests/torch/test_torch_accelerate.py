"""Hugging Face Accelerate over the torch.distributed backend "bpstrain".

Accelerate learns about a distributed run from torchrun's variables, so torchrun starts
the two workers; the scheduler and the server are started by role, as BytePS's are.
"""

from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="Accelerate is optional: pip install 'bpstrain[accelerate]'")

from torchrun_job import run_torchrun_job  # noqa: E402


@pytest.mark.timeout(240)
def test_accelerator_training_loop_on_2_torchrun_workers(tmp_path):
    proc, results = run_torchrun_job(Path(__file__).parent / "accelerate_torchrun_worker.py",
                                     tmp_path, op_timeout=30, timeout=200)
    assert proc.returncode == 0 and len(results) == 2, (proc.stdout + proc.stderr)[-3000:]
    for rank, r in enumerate(results):
        assert (r["rank"], r["bps_rank"], r["size"], r["backend"]) == (rank, rank, 2, "bpstrain"), r
        assert r["multi_cpu"] and r["ddp"] and r["moved"], r
        assert r["max_diff"] < 1e-5, r  # the same weights as one process on both batches
        assert len(r["losses"]) == 3 and all(len(step) == 2 for step in r["losses"]), r
    assert results[0]["losses"] == results[1]["losses"]  # gather: every rank sees both
