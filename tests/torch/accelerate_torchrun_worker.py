"""A torchrun worker: Hugging Face Accelerate's training loop over the bpstrain backend.

The script is Accelerate's usual loop; the only bpstrain lines are the import and
``init_process_group("bpstrain")`` before ``Accelerator`` (which keeps a group that
exists). ``cpu=True`` is Accelerate's own switch for CPU training under torchrun.

Writes ``$RESULT_DIR/<rank>.json``: what Accelerate saw, the gathered losses, and how far
the trained weights are from one process training on every rank's batch at once.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader, TensorDataset

import bpstrain.torch as bps

STEPS, BATCH = 3, 4


def _data(size):
    g = torch.Generator().manual_seed(1)
    n = STEPS * BATCH * size
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def _build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _one_process_reference(size):
    """Accelerate gives rank r batches r, r+size, ...: step k is samples [k*size*B, (k+1)*size*B)."""
    model, opt = _build()
    for x, y in DataLoader(_data(size), batch_size=BATCH * size):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return _flat(model)


dist.init_process_group("bpstrain")
accelerator = Accelerator(cpu=True)
size = accelerator.num_processes
model, opt = _build()
model, opt, loader = accelerator.prepare(model, opt, DataLoader(_data(size), batch_size=BATCH))
losses = []
for x, y in loader:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    accelerator.backward(loss)
    opt.step()
    losses.append(accelerator.gather(loss.detach()).tolist())  # all_gather on the backend
accelerator.wait_for_everyone()  # barrier on the backend
weights = _flat(accelerator.unwrap_model(model))
result = {"rank": accelerator.process_index, "size": size, "bps_rank": bps.rank(),
          "backend": dist.get_backend(),
          "multi_cpu": accelerator.distributed_type == DistributedType.MULTI_CPU,
          "ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel),
          "losses": losses,
          "max_diff": (weights - _one_process_reference(size)).abs().max().item(),
          "moved": not torch.allclose(weights, _flat(_build()[0]))}
with open(os.path.join(os.environ["RESULT_DIR"], f"{accelerator.process_index}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
