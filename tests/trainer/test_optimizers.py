"""Several optimizers from configure_optimizers: each over its own parameters, each with
its schedulers, all stepped every training step (one backward pass)."""

import pytest
import torch

from bpstrain.config import ConfigError
from bpstrain.launch import free_port
from bpstrain.trainer import Callback, Trainer
from bpstrain.trainer.callbacks import read_checkpoint
from tests.trainer.helpers import StepModule, base_config, blobs


class TwoParts(StepModule):
    """StepModule whose first layer and the rest have their own optimizers.

    Args:
        form: What configure_optimizers returns: "one" (a single SGD over everything,
            the reference), "list", "pair" (optimizers, schedulers) or "dicts".
    """

    def __init__(self, form="list"):
        super().__init__()
        self.form = form

    def configure_optimizers(self):
        first, rest = list(self.net[0].parameters()), list(self.net[2].parameters())
        if self.form == "one":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        a, b = torch.optim.SGD(first, lr=0.1), torch.optim.SGD(rest, lr=0.1)
        if self.form == "list":
            return [a, b]
        if self.form == "pair":
            return [a, b], [torch.optim.lr_scheduler.StepLR(a, 1, 0.5),
                            {"scheduler": torch.optim.lr_scheduler.LambdaLR(
                                b, lambda step: 1.0 / (1 + step)), "interval": "step"}]
        adam = torch.optim.Adam(rest, lr=0.01)
        return ({"optimizer": a, "lr_scheduler": torch.optim.lr_scheduler.StepLR(a, 1, 0.5)},
                {"optimizer": adam})


def _fit(tmp_path, form, **extra):
    x, y = blobs(128)
    model = TwoParts(form)
    trainer = Trainer(base_config(tmp_path, **{"trainer.epochs": 2, **extra}))
    history = trainer.fit(model, (x, y), val_data=(x, y))
    return trainer, model, history


@pytest.mark.timeout(60)
@pytest.mark.parametrize("clip", [None, 0.05])
def test_two_optimizers_train_like_one_over_all_parameters(tmp_path, clip):
    # Disjoint halves with plain SGD take exactly the steps of one SGD over everything;
    # gradient clipping by norm sees all parameters together, as with one optimizer.
    one, reference, _ = _fit(tmp_path / "one", "one", **{"trainer.gradient_clip_val": clip})
    two, model, history = _fit(tmp_path / "two", "list", **{"trainer.gradient_clip_val": clip})
    assert len(two.optimizers) == 2 and two.optimizer is two.optimizers[0]
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert history["lr"] == history["lr_1"] == [0.1, 0.1]
    if clip is not None:
        assert float(two.last_grad_norm) == pytest.approx(float(one.last_grad_norm), rel=1e-5)


@pytest.mark.timeout(60)
def test_each_optimizer_has_its_own_schedulers(tmp_path):
    trainer, _, history = _fit(tmp_path, "pair")  # 4 steps per epoch
    assert history["lr"] == pytest.approx([0.1, 0.05])  # StepLR per epoch, optimizer 0
    assert history["lr_1"] == pytest.approx([0.1 / 5, 0.1 / 9])  # per step, optimizer 1
    assert [s.scheduler.optimizer for s in trainer.lr_schedulers] == trainer.optimizers


@pytest.mark.timeout(60)
def test_the_configs_warm_up_drives_every_optimizer(tmp_path):
    class Rates(Callback):
        def __init__(self):
            self.rates = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.rates.append([o.param_groups[0]["lr"] for o in trainer.optimizers])

    rates, x, y = Rates(), *blobs(128)
    cfg = base_config(tmp_path, **{"trainer.epochs": 2, "optimizer.warmup_epochs": 1})
    Trainer(cfg, callbacks=[rates]).fit(TwoParts("list"), (x, y))  # 4 batches per epoch
    assert rates.rates[0] == pytest.approx([0.025, 0.025])  # a quarter through the warm-up
    assert rates.rates[-1] == pytest.approx([0.1, 0.1])


@pytest.mark.timeout(90)
def test_two_optimizers_are_checkpointed_and_resumed(tmp_path):
    x, y = blobs(128)
    straight = Trainer(base_config(tmp_path / "a", **{"trainer.epochs": 4})).fit(
        TwoParts("dicts"), (x, y))
    cfg = base_config(tmp_path / "b", **{"trainer.epochs": 2, "trainer.checkpoint_every": 1})
    first = Trainer(cfg)
    first.fit(TwoParts("dicts"), (x, y))
    ckpt = read_checkpoint(first.run_dir / "checkpoints" / "last.ckpt")
    assert len(ckpt["other_optimizers"]) == 1 and ckpt["other_optimizers"][0]["state"]  # Adam
    resumed = Trainer({**cfg, "trainer.epochs": 4, "trainer.resume": "auto"}).fit(
        TwoParts("dicts"), (x, y))
    assert resumed["lr"] == pytest.approx(straight["lr"]) == [0.1, 0.05, 0.025, 0.0125]
    assert resumed["lr_1"] == [0.01] * 4
    with pytest.raises(ValueError, match="holds the state of 2 optimizer"):
        Trainer({**cfg, "trainer.epochs": 5, "trainer.resume": "auto"}).fit(
            TwoParts("one"), (x, y))


@pytest.mark.timeout(30)
def test_shared_parameters_and_manual_optimization_are_refused(tmp_path):
    x, y = blobs(64)

    class Shared(StepModule):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), 0.1),
                    torch.optim.SGD(self.net[0].parameters(), 1)]

    class Manual(TwoParts):
        automatic_optimization = False

    with pytest.raises(TypeError, match="in two optimizers"):
        Trainer(base_config(tmp_path)).fit(Shared(), (x, y))
    with pytest.raises(ConfigError, match="manual optimization"):
        Trainer(base_config(tmp_path)).fit(Manual(), (x, y))
    with pytest.raises(TypeError, match="no optimizer"):
        Trainer(base_config(tmp_path)).fit(type("Empty", (StepModule,), {
            "configure_optimizers": lambda self: []})(), (x, y))


@pytest.mark.timeout(180)
def test_two_optimizers_in_a_two_worker_job_match_one(tmp_path):
    # Each optimizer is wrapped in its own DistributedOptimizer: averaged gradients, and
    # the same weights as one distributed SGD over all parameters.
    x, y = blobs(128)
    results = []
    for form in ("one", "list"):
        model = TwoParts(form)
        cfg = base_config(tmp_path / form, **{"cluster.workers": 2, "cluster.port": free_port(),
                                              "trainer.epochs": 1})
        history = Trainer(cfg).fit(model, (x, y))
        results.append((model, history))
    (one, h_one), (two, h_two) = results
    assert h_two["loss"] == pytest.approx(h_one["loss"], rel=1e-5)
    for a, b in zip(one.parameters(), two.parameters()):
        assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(two.net[0].weight, TwoParts().net[0].weight)  # it trained

