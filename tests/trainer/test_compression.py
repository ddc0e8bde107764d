"""comm.compression in the Trainer: a 2-worker local cluster trains with top-k 1 %, its
checkpoints hold every rank's error-feedback state, and a resume gives it back."""

import pytest
import torch

from bpstrain.config import ConfigError
from bpstrain.launch import free_port
from bpstrain.trainer import Trainer
from bpstrain.trainer.callbacks.checkpoint import read_checkpoint
from tests.trainer.helpers import CompressionProbe, base_config, blobs, tensor_total, tiny_net


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


def test_a_bad_compression_key_fails_before_any_worker_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"comm.compression' must be a compression spec.*"
                                          r"Received: comm.compression='topk:2'"):
        Trainer(_config(tmp_path, **{"comm.compression": "topk:2"}))
