"""comm.consistency under bpstrain.torch (see torch_check_worker.py). The digits run is
launched once per mode and the tests compare what it returns; the other checks need
the mode named in their docstring."""

import hashlib
import time

import numpy as np
import torch

import bpstrain.torch as bps
from bpstrain import engine
from bpstrain.models import digits_dataset, get_model


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_digits_200_steps_fingerprint():
    """Any mode: 200 steps of digits_cnn, SGD with momentum; returns the final weights'
    digest (sync and ssp:0 must agree bit for bit) and the test accuracy."""
    r, n = bps.rank(), bps.size()
    torch.manual_seed(0)
    model = get_model("digits_cnn")
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    train, test = digits_dataset("train"), digits_dataset("test")
    x, y = train.tensors
    shard = torch.arange(r, len(y), n)
    gen = torch.Generator().manual_seed(r)
    for _ in range(200):
        idx = shard[torch.randint(len(shard), (32,), generator=gen)]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = _flat(model)
    ref = bps.broadcast(flat.clone(), root_rank=0, name="consistency.check.params")
    if engine.options()["consistency"] in ("sync", "ssp:0"):
        assert torch.equal(flat, ref), "ranks ended with different weights"
    with torch.no_grad():
        accuracy = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
    return {"digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(), "accuracy": accuracy,
            "max_staleness": engine.stats().get("max_staleness", 0)}


def check_async_lr_0_keeps_rank_0_initial_weights_exactly():
    """async: ranks start from different models; with lr 0 every rank ends at rank 0's."""
    assert engine.options()["consistency"] == "async"
    r = bps.rank()
    torch.manual_seed(10 + r)  # different on every rank, and no broadcast_parameters
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    rank0 = bps.broadcast(_flat(model).clone(), root_rank=0, name="consistency.check.init")
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9,
                                                   weight_decay=0.01),
                                   named_parameters=model.named_parameters())
    gen = torch.Generator().manual_seed(r)
    for _ in range(20):
        x = torch.randn(16, 8, generator=gen)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.equal(_flat(model), rank0), (_flat(model) - rank0).abs().max()
    assert engine.stats()["weight_answers"] > 0


SSP_BOUND, SSP_STEPS, SLOW_STEP_S, LR = 2, 10, 0.25, 0.1


def _regression_batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 4, generator=gen)
    return x, x @ torch.arange(1.0, 5.0) + 0.5


def _loss(weight, rank, step):
    """A worker's loss at ``weight`` (1 x 4), the same ops in the job and in the replay."""
    x, y = _regression_batch(rank, step)
    return ((torch.nn.functional.linear(x, weight).squeeze(1) - y) ** 2).mean()


def _gradient(w, rank, step):
    p = torch.nn.Parameter(w.clone())
    _loss(p, rank, step).backward()
    return p.grad


def simulate_ssp(bound, delays, steps, w0, lr, momentum):
    """In-process replay of ssp:<bound> (param_store.h's rules) for workers whose step k
    takes delays[r] seconds: returns the weights each worker received after each step."""
    n = len(delays)
    server = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([server], lr=lr, momentum=momentum)
    applied, pending, waiting = 0, {}, []
    got = [[] for _ in range(n)]
    events = [(delays[r], r, 1, w0.clone()) for r in range(n)]  # (push time, rank, clock, weights read)
    while events:
        events.sort(key=lambda e: (e[0], e[1]))
        now, r, clock, w = events.pop(0)
        pending.setdefault(clock, []).append(_gradient(w, r, clock - 1))
        while len(pending.get(applied + 1, [])) == n:
            grads = pending.pop(applied + 1)
            total = grads[0].clone()
            for g in grads[1:]:
                total += g
            server.grad = total * np.float32(1.0 / n)
            opt.step()
            applied += 1
        waiting.append((r, clock))
        for wr, wc in [item for item in waiting if item[1] - bound <= applied]:
            waiting.remove((wr, wc))
            got[wr].append(server.detach().clone())
            if wc < steps:
                events.append((now + delays[wr], wr, wc + 1, server.detach().clone()))
    return got


def check_ssp_with_a_scripted_slow_rank_equals_the_simulation():
    """ssp:2, 2 workers: rank 1 sleeps SLOW_STEP_S before each push, so rank 0 runs two
    clocks ahead and waits; every weight either received equals the in-process replay."""
    assert engine.options()["consistency"] == f"ssp:{SSP_BOUND}" and bps.size() == 2
    r = bps.rank()
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5),
                                   named_parameters=model.named_parameters())
    opt.initialize_server_weights()  # both start the clock together; the first push then overlaps
    got = []
    for step in range(SSP_STEPS):
        loss = _loss(model.weight, r, step)
        opt.zero_grad()
        if r == 1:
            time.sleep(SLOW_STEP_S)
        loss.backward()  # pushes the gradient
        opt.step()
        got.append(model.weight.detach().clone())
    expected = simulate_ssp(SSP_BOUND, [0.0, SLOW_STEP_S], SSP_STEPS, torch.zeros(1, 4), LR, 0.5)[r]
    for step, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"step {step}: received {a.tolist()}, the replay says {b.tolist()}"
    if r == 0:  # it really ran ahead: its answers lacked up to SSP_BOUND of its own clocks
        assert engine.stats()["max_staleness"] == SSP_BOUND
