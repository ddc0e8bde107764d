"""comm.compression in the Trainer: a 2-worker local cluster trains with top-k 1 %, its
checkpoints hold every rank's error-feedback state, and a resume gives it back."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bpstrain.config import ConfigError
from bpstrain.launch import free_port
from bpstrain.trainer import Trainer
from bpstrain.trainer.callbacks.checkpoint import read_checkpoint
from tests.trainer.helpers import CompressionProbe, base_config, blobs, tensor_total, tiny_net
from tests.result_lines import read_results


def _config(tmp_path, **extra):
    return base_config(tmp_path, **{
        "cluster.workers": 2, "cluster.port": free_port(), "comm.compression": "topk:0.01",
        # tiny_net's tensors are small: compress them all (the default skips < 1024).
        "comm.compression_min_size": 0, "trainer.checkpoint_every": 1, **extra})


@pytest.mark.timeout(180)
def test_two_workers_train_with_topk_and_checkpoints_carry_every_ranks_residuals(tmp_path):
    x, y = blobs(256)
    model = tiny_net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe = CompressionProbe()
    history = Trainer(_config(tmp_path, **{"trainer.epochs": 2}), callbacks=[probe]).fit(
        model, (x, y), val_data=(x, y))
    assert len(history) == 2 and all(loss == loss for loss in history["loss"])
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert probe.at_start == 0 and all(total > 0 for total in probe.at_epoch_end)

    ckpt = read_checkpoint(tmp_path / "version_0" / "checkpoints" / "last.ckpt")
    states = ckpt["compression_states"]
    assert len(states) == 2 and all(len(per_rank) == 1 for per_rank in states)
    # The workers' residuals ("servers": the servers' ones, where the optimizer exports them).
    totals = [tensor_total({k: v for k, v in per_rank[0].items() if k != "servers"})
              for per_rank in states]
    assert all(t > 0 for t in totals) and totals[0] != totals[1]  # each rank its own
    # Rank 0's residuals at the last epoch's end are what its entry holds.
    assert totals[0] == pytest.approx(probe.at_epoch_end[-1], rel=1e-6)

    # Resumed, each rank starts from its own residuals instead of zero.
    probe = CompressionProbe()
    again = Trainer(_config(tmp_path, **{"trainer.epochs": 3, "trainer.resume": "auto"}),
                    callbacks=[probe])
    history = again.fit(tiny_net(), (x, y), val_data=(x, y))
    assert [e["epoch"] for e in history.epochs] == [0, 1, 2]
    assert probe.at_start == pytest.approx(totals[0], rel=1e-6)


@pytest.mark.timeout(30)
def test_a_bad_compression_key_fails_before_any_worker_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"comm.compression' must be a compression spec.*"
                                          r"Received: comm.compression='topk:2'"):
        Trainer(_config(tmp_path, **{"comm.compression": "topk:2"}))


@pytest.mark.timeout(240)
def test_keras_model_trains_with_compression_rules_in_a_launched_job(tmp_path):
    pytest.importorskip("keras")
    root = Path(__file__).resolve().parents[2]
    script = root / "tests" / "trainer" / "scripts" / "keras_compression_in_job.py"
    proc = subprocess.run(
        [sys.executable, "-m", "bpstrain.launch", "--workers", "2", "--servers", "1", "--",
         sys.executable, str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=230, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "TF_CPP_MIN_LOG_LEVEL": "2",
             "KERAS_BACKEND": "tensorflow"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = read_results(proc.stdout)
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert results[0]["weights"] == results[1]["weights"]  # the servers answer all alike
    assert results[0]["last"]["val_accuracy"] > 0.8, results[0]["last"]
    for r in results:  # kernels by the rule, biases by the default
        assert r["compressor"] == "PolicyCompressor"
        assert [k.split("|")[0] for k in r["state"]] == ["onebit"] * 2 + ["topk:ratio=0.25"] * 2


@pytest.mark.timeout(60)
def test_keras_compile_wraps_with_the_policy_and_runs_auto_eagerly(standalone_engine, tmp_path):
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the Keras codecs are TensorFlow ops")
    from bpstrain._compression import parse_policy
    from bpstrain.config import load_config
    from bpstrain.tensorflow.compression import PolicyCompressor
    from bpstrain.trainer._keras import _compile

    cfg = load_config(base_config(tmp_path))
    for spec, eager in (("topk:0.01", False), ("auto:onebit", True)):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        _compile(model, cfg, 2, compression=parse_policy(spec, min_size=0))
        assert isinstance(model.optimizer._bps_compression, PolicyCompressor)
        assert bool(model.run_eagerly) is eager, spec


@pytest.mark.timeout(180)
def test_two_workers_train_with_momentum_correction_and_checkpoint_its_velocity(tmp_path):
    x, y = blobs(256)
    cfg = _config(tmp_path, **{"comm.compression": "topk:0.1:momentum=0.9", "optimizer.name": "sgd",
                               "optimizer.lr": 0.05, "trainer.epochs": 3})  # SGD's momentum: 0.9
    history = Trainer(cfg).fit(tiny_net(), (x, y), val_data=(x, y))
    assert history.last["val_accuracy"] > 0.9
    ckpt = read_checkpoint(tmp_path / "version_0" / "checkpoints" / "last.ckpt")
    for per_rank in ckpt["compression_states"]:
        tensors = per_rank[0]["compressors"]["topk:ratio=0.1:momentum=0.9"]["tensors"]
        assert tensors and all({"velocity", "applied", "residual"} <= set(t) for t in tensors.values())
