"""DistributedOptimizer and DistributedDataParallel checks (see torch_check_worker.py)."""

import copy
import warnings

import torch
from torch import nn

import bpstrain.torch as bps
from bpstrain.torch.parallel import DistributedDataParallel


def _mlp(device="cpu", dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(device, dtype)


def _x(k, device="cpu", dtype=torch.float64):
    return torch.linspace(-1, 1, 8, dtype=dtype, device=device).reshape(2, 4) * (k + 1)


def _mean_grads(model, inputs):
    """Average over ranks k of the gradient of model(inputs[k]).sum(), computed locally."""
    ref = copy.deepcopy(model)
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for x in inputs:
        ref.zero_grad()
        ref(x).sum().backward()
        total = [t + p.grad for t, p in zip(total, ref.parameters())]
    return [t / len(inputs) for t in total]


def check_optimizer_is_dynamic_subclass_and_validates_names():
    model = _mlp()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert type(opt) is not torch.optim.SGD
    named = list(model.named_parameters())
    cases = {"unique": [named[0], (named[0][0], named[1][1])] + named[2:],
             "does not name every": named[:2], "tuples": [p for _, p in named]}
    for message, bad in cases.items():
        try:
            bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=bad)
            raise AssertionError(f"accepted bad named_parameters ({message})")
        except ValueError as exc:
            assert message in str(exc), exc


def check_optimizer_averages_and_starts_push_pull_during_backward():
    r, n = bps.rank(), bps.size()
    for fusion in (1 << 20, 0):  # small parameters fused into one bucket, or one op each
        model = _mlp()
        want = [p.detach() - g for p, g in zip(model.parameters(),
                                               _mean_grads(model, [_x(k) for k in range(n)]))]
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters(),
                                       fusion_threshold_bytes=fusion)
        model(_x(r)).sum().backward()
        # Every push_pull was started by the hooks, before step():
        assert opt.in_flight() == (1 if fusion else 4), (fusion, opt.in_flight())
        opt.step()
        for p, w in zip(model.parameters(), want):
            assert torch.allclose(p, w, atol=1e-12), (fusion, p, w)


def check_backward_passes_per_step_accumulates_then_asserts():
    r, n = bps.rank(), bps.size()
    model = _mlp()
    g1 = _mean_grads(model, [_x(k) for k in range(n)])
    g2 = _mean_grads(model, [_x(k + 3) for k in range(n)])
    want = [p.detach() - a - b for p, a, b in zip(model.parameters(), g1, g2)]
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    model(_x(r)).sum().backward()
    model(_x(r + 3)).sum().backward()
    opt.step()
    for p, w in zip(model.parameters(), want):
        assert torch.allclose(p, w, atol=1e-12)
    opt.zero_grad()
    for i in range(3):
        try:
            model(_x(r)).sum().backward()
            assert i < 2, "third backward pass should raise"
        except AssertionError as exc:
            assert i == 2 and "backward_passes_per_step" in str(exc), exc
    opt.step()  # every rank failed at the same point: finish the pending push_pulls


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.never = nn.Linear(4, 2), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x, use_b):
        return self.a(x) + (self.b(x) if use_b else 0)


def check_unused_parameters_and_none_grads_do_not_hang():
    r, n = bps.rank(), bps.size()
    model = _Branches().double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    model(_x(r), use_b=(r == 0)).sum().backward()
    opt.step()
    x0 = _x(0)
    want_b_bias = before["b.bias"] - 2.0 / n  # only rank 0 used b: its gradient / n
    assert torch.allclose(model.b.bias, want_b_bias), model.b.bias
    assert torch.allclose(model.b.weight, before["b.weight"] - x0.sum(0) / n)
    assert model.never.weight.grad is None and torch.equal(model.never.weight, before["never.weight"])
    opt.zero_grad()  # all None now
    opt.step()  # no backward at all on any rank
    if r == 0:  # backward on rank 0 only: the others push zeros
        model(_x(0), use_b=True).sum().backward()
    opt.step()
    assert torch.allclose(model.a.bias, before["a.bias"] - 2.0 - 2.0 / n)


def check_frozen_and_requires_grad_switched_between_two_optimizers():
    r, n = bps.rank(), bps.size()
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 4).double(), nn.Linear(4, 1).double()
    disc.weight.requires_grad_(False)  # frozen when its optimizer is built, unfrozen later
    disc_before = disc.weight.detach().clone()
    opt_g = bps.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1),
                                     named_parameters=gen.named_parameters())
    opt_d = bps.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                     named_parameters=disc.named_parameters())
    disc.weight.requires_grad_(True)
    for _ in range(2):
        gen.requires_grad_(False)
        disc.requires_grad_(True)
        opt_d.zero_grad()
        disc(gen(_x(r))).sum().backward()
        opt_d.step()
        gen.requires_grad_(True)
        disc.requires_grad_(False)
        opt_g.zero_grad()
        (-disc(gen(_x(r)))).sum().backward()
        opt_g.step()
    state = {**{"g." + k: v for k, v in gen.state_dict().items()},
             **{"d." + k: v for k, v in disc.state_dict().items()}}
    want = bps.broadcast_object(state, root_rank=0)
    assert all(torch.equal(v, want[k]) for k, v in state.items())
    assert not torch.equal(disc.weight, disc_before), "unfrozen weight was never trained"


def check_synchronize_clip_skip_synchronize_warning_and_zero_grad_guard():
    r = bps.rank()
    model = _mlp()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(_x(r)).sum().backward()
        opt.synchronize()
        nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        with opt.skip_synchronize():
            opt.step()
        assert not caught, [str(w.message) for w in caught]
        opt.zero_grad()
        model(_x(r)).sum().backward()
        opt.synchronize()
        opt.step()
        assert any("skip_synchronize" in str(w.message) for w in caught)
    model(_x(r)).sum().backward()
    try:
        opt.zero_grad()
        raise AssertionError("zero_grad() with push_pulls in flight must fail")
    except AssertionError as exc:
        assert "zero_grad" in str(exc) and "prohibited" in str(exc), exc
    opt.step()


def check_optimizer_fp16_compression():
    r, n = bps.rank(), bps.size()
    model = _mlp(dtype=torch.float32)
    want = [p.detach() - g for p, g in zip(
        model.parameters(), _mean_grads(model, [_x(k, dtype=torch.float32) for k in range(n)]))]
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   compression=bps.Compression.fp16)
    model(_x(r, dtype=torch.float32)).sum().backward()
    opt.step()
    for p, w in zip(model.parameters(), want):
        assert p.dtype == torch.float32 and torch.allclose(p, w, atol=5e-3), (p, w)


def check_ddp_broadcasts_averages_no_sync_and_buffers():
    r, n = bps.rank(), bps.size()
    torch.manual_seed(r)  # different initial weights per rank
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=0.0), nn.Linear(8, 2)).double()
    ddp = DistributedDataParallel(model)
    want = bps.broadcast_object(model.state_dict(), root_rank=0)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    g = _mean_grads(model, [_x(k) for k in range(n)])
    ddp(_x(r)).sum().backward()
    assert all(torch.allclose(p.grad, w, atol=1e-12) for p, w in zip(model.parameters(), g))
    model.zero_grad()
    g2 = _mean_grads(model, [_x(k + 2) for k in range(n)])
    with ddp.no_sync():
        ddp(_x(r)).sum().backward()
    ddp(_x(r + 2)).sum().backward()
    assert all(torch.allclose(p.grad, a + b, atol=1e-12)
               for p, a, b in zip(model.parameters(), g, g2))
    with torch.no_grad():
        model[1].running_mean.fill_(float(r))
    ddp(_x(r))  # training-mode forward copies rank 0's buffers first
    assert torch.equal(model[1].running_mean, torch.zeros(8, dtype=torch.float64))


def check_equivalence_n_workers_vs_one_process():
    """N workers x batch B with a mean loss == one process with batch N*B, 5 steps."""
    r, n = bps.rank(), bps.size()
    batch = 4
    torch.manual_seed(123)
    data, target = torch.randn(n * batch, 6), torch.randn(n * batch, 3)
    mine = slice(r * batch, (r + 1) * batch)
    for kind in ("optimizer", "ddp"):
        torch.manual_seed(7)
        ref = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        model = copy.deepcopy(ref)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        if kind == "optimizer":
            opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=model.named_parameters())
            net = model
        else:
            net = DistributedDataParallel(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(5):
            ref_opt.zero_grad()
            nn.functional.mse_loss(ref(data), target).backward()
            ref_opt.step()
            opt.zero_grad()
            nn.functional.mse_loss(net(data[mine]), target[mine]).backward()
            opt.step()
        diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
        assert diff < 1e-5, (kind, diff)
