"""Lightning's Trainer with bpstrain.torch.lightning.BpstrainStrategy in a launched job."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="Lightning is optional: pip install 'bpstrain[lightning]'")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_torch_jobs import _assert_check, run_job  # noqa: E402

GROUPS = ["torch_checks_lightning"]


@pytest.mark.timeout(300)
def test_lightning_trainer_on_2_workers():
    _assert_check(run_job(2, 1, GROUPS), "check_lightning_trainer_on_bpstrain_matches_one_big_batch", 2)


@pytest.mark.timeout(60)
def test_lightning_job_exits_cleanly():
    proc, _ = run_job(2, 1, GROUPS)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
