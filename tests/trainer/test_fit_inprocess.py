"""fit in this process (cluster.workers=1): every data form, both loss styles, history."""

import matplotlib
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bpstrain.trainer import History, Trainer
from tests.trainer.helpers import StepModule, base_config, blobs, tiny_net

matplotlib.use("Agg")


def _dataset():
    x, y = blobs(128)
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("form", ["arrays", "dataset", "dataloader", "callable"])
def test_fit_accepts_every_data_form(form, tmp_path):
    x, y = blobs(128)
    data = {"arrays": lambda: (x, y), "dataset": _dataset,
            "dataloader": lambda: DataLoader(_dataset(), batch_size=16),
            "callable": lambda: _dataset}[form]()
    trainer = Trainer(base_config(tmp_path, **{"trainer.epochs": 3}))
    history = trainer.fit(tiny_net(), data, val_data=(x, y))
    assert trainer.num_training_batches == (8 if form == "dataloader" else 4)
    assert len(history) == 3 and history.last["val_accuracy"] > 0.9


@pytest.mark.timeout(60)
def test_training_step_module_and_custom_metrics(tmp_path):
    x, y = blobs(128)
    history = Trainer(base_config(tmp_path, **{"trainer.epochs": 3})).fit(
        StepModule(), (x, y), val_data=(x, y))
    assert {"loss", "acc", "val_loss", "val_acc"} <= set(history.last)
    assert history.last["val_acc"] > 0.9


@pytest.mark.timeout(60)
def test_steps_cap_and_regression_loss(tmp_path):
    x = torch.randn(200, 8)
    y = x.sum(dim=1, keepdim=True)
    trainer = Trainer(base_config(tmp_path, **{"trainer.steps": 3, "trainer.loss": "mse"}))
    history = trainer.fit(torch.nn.Linear(8, 1), (x, y))
    assert trainer.num_training_batches == 3 and "accuracy" not in history.last


@pytest.mark.timeout(60)
def test_history_plot_and_bad_data(tmp_path):
    x, y = blobs(64)
    history = Trainer(base_config(tmp_path)).fit(tiny_net(), (x, y), val_data=(x, y))
    assert history["loss"] == history.history["loss"] and len(history["loss"]) == 2
    fig = history.plot()
    assert len(fig.axes) == 2  # losses | accuracies
    assert History.from_dict(history.to_dict()).epochs == history.epochs
    with pytest.raises(KeyError, match="Received: key='nope'"):
        history["nope"]
    with pytest.raises(TypeError, match="Received: str"):
        Trainer(base_config(tmp_path)).fit(tiny_net(), "not data")
