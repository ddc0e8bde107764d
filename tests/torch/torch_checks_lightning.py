"""Lightning's Trainer on bpstrain (BpstrainStrategy), run on every rank of a launched job."""

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning as L
import torch.distributed as dist

from bpstrain.torch.lightning import BpstrainStrategy

STEPS_PER_EPOCH, BATCH, EPOCHS = 3, 4, 2


class _Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.losses = []

    def training_step(self, batch, index):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.5)


def _data(size):
    g = torch.Generator().manual_seed(1)
    n = STEPS_PER_EPOCH * BATCH * size
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def _one_process_reference(size):
    """The same training in one process: each step's batch is every rank's batch at once."""
    model = _Classifier()
    data = _data(size)
    opt = model.configure_optimizers()
    for epoch in range(EPOCHS):
        # Lightning shards with torch's DistributedSampler (shuffled, seed 0, set_epoch).
        order = []
        for r in range(size):
            sampler = DistributedSampler(data, num_replicas=size, rank=r, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            order.append(list(sampler))
        for step in range(STEPS_PER_EPOCH):
            idx = [i for r in range(size) for i in order[r][step * BATCH:(step + 1) * BATCH]]
            x, y = data[idx]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model.net(x), y).backward()
            opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_lightning_trainer_on_bpstrain_matches_one_big_batch():
    trainer = L.Trainer(strategy=BpstrainStrategy(), accelerator="cpu", max_epochs=EPOCHS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    model = _Classifier()
    size = trainer.world_size
    trainer.fit(model, DataLoader(_data(size), batch_size=BATCH))
    assert dist.get_backend() == "bpstrain" and size >= 2, (dist.get_backend(), size)
    assert trainer.global_step == EPOCHS * STEPS_PER_EPOCH, trainer.global_step
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = _one_process_reference(size)
    assert torch.allclose(weights, reference, atol=1e-5), (weights - reference).abs().max()
    assert not torch.allclose(weights, torch.cat([p.detach().reshape(-1) for p in _Classifier().parameters()]))
    logged = trainer.callback_metrics["train_loss"]  # sync_dist: the same on every rank
    same = logged.clone()
    dist.broadcast(same, src=0)
    assert torch.equal(logged, same), (logged, same)
