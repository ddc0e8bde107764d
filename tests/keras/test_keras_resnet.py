"""The Keras ResNet-50 example and benchmark: table arithmetic, and one real tiny run."""

import sys
from pathlib import Path

import pytest

from bpstrain.bench import keras_resnet

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launched_job import launch  # noqa: E402


@pytest.mark.timeout(30)
def test_rows_sum_workers_and_compute_efficiency(monkeypatch):
    per_worker = {1: 10.0, 2: 9.0, 4: 6.0}  # samples/s of each worker, by job size

    def fake_job(hosts, layout, plan):
        n = len(layout.worker_hosts)
        assert layout.server_hosts == [4] and layout.scheduler_host == 5
        return [{"results": [{"samples_per_s": per_worker[n], "step_s": 16 / per_worker[n]}]}
                for _ in range(n)]

    monkeypatch.setattr(keras_resnet, "_run_job", fake_job)
    plan = keras_resnet.Plan(workers=(1, 2, 4), loopback=True)
    rows = keras_resnet.run(plan, log=lambda msg: None)
    assert [r["samples_per_s"] for r in rows] == [10.0, 18.0, 24.0]
    assert [r["efficiency"] for r in rows] == [1.0, 0.9, 0.6]
    table = keras_resnet.format_rows(rows, plan)
    assert "scaling eff." in table and " 90%" in table and " 60%" in table


@pytest.mark.timeout(30)
def test_bad_arguments_exit_2(capsys):
    assert keras_resnet.main(["--workers", "0", "--loopback"]) == 2
    assert "Received: workers=[0]" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_example_trains_on_two_workers():
    code, out, _ = launch([sys.executable, "-m", "bpstrain.keras.examples.resnet50_synthetic",
                           "--steps", "3", "--warmup-steps", "1", "--image-size", "32",
                           "--batch-size", "2", "--threads", "1"], 2,
                          {"KERAS_BACKEND": "tensorflow"}, timeout=220)
    assert code == 0, out[-4000:]
    for rank in (0, 1):
        assert f"[worker {rank}] rank {rank} of 2: " in out, out[-4000:]
