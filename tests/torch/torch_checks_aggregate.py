"""k-of-n aggregation under bpstrain.torch (see torch_check_worker.py): run with 3 workers
and BPSTRAIN_AGGREGATE=k:2; the last rank is slow on every step."""

import time

import torch

import bpstrain.torch as bps
from bpstrain import engine


def check_a_slow_rank_does_not_count_yet_every_rank_keeps_the_same_model():
    r, n = bps.rank(), bps.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    late_before = engine.stats()["late_partitions"]
    gen = torch.Generator().manual_seed(100 + r)
    for step in range(8):
        x = torch.randn(32, 8, generator=gen)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        if r == n - 1:
            time.sleep(0.3)  # a straggler: its pushes (from backward) come after the others'
        loss.backward()
        opt.step()
    late = engine.stats()["late_partitions"] - late_before
    if r == n - 1:
        assert late > 0, "the slow rank's pushes all counted"
    # every rank applied the same averaged gradients: identical parameters
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = bps.broadcast(flat.clone(), root_rank=0, name="aggregate.check.params")
    assert torch.equal(flat, ref), (flat - ref).abs().max()


def check_catch_up_lets_a_slow_rank_skip_rounds_and_keep_the_same_model():
    r, n = bps.rank(), bps.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), catch_up=True)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(100 + r)
    steps, rounds = 0, 12
    while opt.rounds < rounds:  # the loop ends by rounds: the slow rank takes fewer steps
        x = torch.randn(32, 8, generator=gen)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        if r == n - 1:
            time.sleep(0.4)
        loss.backward()
        opt.step()
        steps += 1
    assert opt.rounds == rounds
    if r == n - 1:
        assert steps < rounds, f"the slow rank computed all {steps} rounds itself"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = bps.broadcast(flat.clone(), root_rank=0, name="aggregate.check.catch_up")
    assert torch.equal(flat, ref), (flat - ref).abs().max()
