"""A torchrun worker: init_process_group("bpstrain") with torchrun's variables, DDP steps.

Writes ``$RESULT_DIR/<rank>.json`` with its ranks, an all_reduce and the weights (a file per
rank: two ranks printing to one pipe can interleave their lines).
"""

import json
import os

import torch
import torch.distributed as dist

import bpstrain.torch as bps

dist.init_process_group("bpstrain")
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
    opt.step()
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
result = {"rank": rank, "size": size, "env_rank": int(os.environ["RANK"]),
          "bps_rank": bps.rank(), "sum": t.item(), "weights": weights.tolist()}
with open(os.path.join(os.environ["RESULT_DIR"], f"{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
