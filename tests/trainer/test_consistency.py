"""comm.consistency as a Trainer setting: a 2-worker local cluster trains with the
optimizer on the servers (ssp:<s>, async); ssp:0 ends exactly where sync does."""

import pytest
import torch

from bpstrain.config import ConfigError
from bpstrain.launch import free_port
from bpstrain.trainer import Trainer
from tests.trainer.helpers import base_config, blobs, tiny_net


def _fit(tmp_path, consistency, optimizer="sgd"):
    x, y = blobs(256)
    torch.manual_seed(0)
    model = tiny_net()
    cfg = base_config(tmp_path / consistency.replace(":", "_"), **{
        "cluster.workers": 2, "cluster.port": free_port(), "comm.consistency": consistency,
        "optimizer.name": optimizer, "optimizer.lr": 0.05, "trainer.epochs": 2})
    history = Trainer(cfg).fit(model, (x, y), val_data=(x, y))
    return model, history


@pytest.mark.timeout(240)
def test_ssp_0_in_the_trainer_ends_where_sync_does_and_async_trains(tmp_path):
    synced, sync_history = _fit(tmp_path, "sync")
    ssp0, _ = _fit(tmp_path, "ssp:0")
    for (name, a), b in zip(synced.state_dict().items(), ssp0.state_dict().values()):
        assert torch.equal(a, b), name
    assert sync_history["loss"][-1] < sync_history["loss"][0]
    _, history = _fit(tmp_path, "async", optimizer="adam")
    assert history["loss"][-1] < history["loss"][0]


@pytest.mark.timeout(30)
def test_a_bad_consistency_fails_before_any_worker_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"comm.consistency.*Received: comm.consistency='ssp'"):
        Trainer(base_config(tmp_path, **{"cluster.workers": 2, "comm.consistency": "ssp"}))
