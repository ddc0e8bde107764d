"""A torchrun worker: init_process_group("bpstrain") with torchrun's variables, DDP steps.

Prints ``RESULT {json}`` with its ranks, an all_reduce and a weight checksum.
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
print("RESULT " + json.dumps({"rank": rank, "size": size, "env_rank": int(os.environ["RANK"]),
                              "bps_rank": bps.rank(), "sum": t.item(), "weights": weights.tolist()}),
      flush=True)
dist.destroy_process_group()
