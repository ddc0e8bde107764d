"""bpstrain.bench.training: table helpers, and a short loopback run of every system.

The emulated-cluster run (root, network namespaces) is the benchmark itself:
``python -m bpstrain.bench.training --model vgg16 --hosts 4 --servers 4 --rate-mbit 800``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bpstrain.bench import training

REPO = Path(__file__).resolve().parents[2]


def test_step_time_takes_the_slowest_rank_per_step():
    payloads = [{"results": [{"times": [1.0, 3.0]}]}, {"results": [{"times": [2.0, 1.0]}]}]
    assert training._step_time(payloads) == 2.5


def test_table_has_one_line_per_row_and_the_ratio():
    rows = [training.TrainRow("vgg16", "bpstrain", 4, 4, 8, 5.0, 6.4, 5.5, 1.6),
            training.TrainRow("vgg16", "ddp", 4, None, 8, 8.0, 4.0, 8.3, 1.0)]
    lines = training.format_table(rows).splitlines()
    assert len(lines) == 4 and "1.60x" in lines[2] and lines[3].split()[3] == "-"


@pytest.mark.timeout(240)
def test_loopback_run_of_every_system(tmp_path):
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "bpstrain.bench.training", "--loopback", "--model", "resnet50",
         "--hosts", "2", "--servers", "1", "--batch-size", "2", "--iters", "1", "--warmup", "0",
         "--num-classes", "10", "--timeout", "200", "--json", str(out),
         "--systems", "bpstrain", "bpstrain-cb", "ddp-bpstrain", "ddp"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["system"] for r in rows] == ["bpstrain", "bpstrain-cb", "ddp-bpstrain", "ddp"]
    assert all(r["samples_per_s"] > 0 for r in rows) and rows[3]["vs_ddp"] == 1.0
    assert rows[1]["servers"] == 1 and rows[2]["servers"] == 1 and rows[3]["servers"] is None
    assert "samples/s" in proc.stdout
