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


def max_param_diff(a, b):
    """Largest absolute difference between two models' parameters, in order."""
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


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
        diff = max_param_diff(ref, model)
        assert diff < 1e-5, (kind, diff)


def _cross_barrier_run(make_opt, fusion, device="cpu", steps=5):
    """Trains a small net with CrossBarrier on this rank's slice; returns (ref, model).

    ``ref`` is one process on the whole batch with the same optimizer: after
    synchronize() both must hold the same parameters (float64 keeps rounding out).
    """
    r, n = bps.rank(), bps.size()
    batch = 4
    torch.manual_seed(123)
    data = torch.randn(n * batch, 6, dtype=torch.float64, device=device)
    target = torch.randn(n * batch, 3, dtype=torch.float64, device=device)
    mine = slice(r * batch, (r + 1) * batch)
    torch.manual_seed(7)
    ref = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh(),
                        nn.Linear(8, 3)).to(device, torch.float64)
    model = copy.deepcopy(ref)
    ref_opt = make_opt(ref.parameters())
    opt = bps.CrossBarrier(model, make_opt(model.parameters()),
                           named_parameters=model.named_parameters(),
                           fusion_threshold_bytes=fusion)
    for _ in range(steps):
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(data), target).backward()
        ref_opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(model(data[mine]), target[mine]).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        # Nothing was updated yet: the next forward (or synchronize) applies the step.
        assert opt.pending_updates() == len(before), opt.pending_updates()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return ref, ref_opt, model, opt


def check_cross_barrier_equals_one_process_sgd_adam_fused_or_not():
    """CrossBarrier gives the single-process parameters (SGD+momentum, Adam; fused or not)."""
    optimizers = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                  "adam": lambda ps: torch.optim.Adam(ps, lr=0.01)}
    for kind, make_opt in optimizers.items():
        for fusion in (0, 1 << 20):
            ref, ref_opt, model, opt = _cross_barrier_run(make_opt, fusion)
            opt.synchronize()
            assert opt.pending_updates() == 0
            pairs = list(zip(ref.parameters(), model.parameters()))
            diff = max_param_diff(ref, model)
            assert diff < 1e-9, (kind, fusion, diff)
            # The per-parameter state (momentum, Adam's moments and step) matches too.
            for a, b in pairs:
                sa, sb = ref_opt.state[a], opt.state[b]
                assert sorted(sa) == sorted(sb), (kind, sorted(sa), sorted(sb))
                for name in sa:
                    assert torch.allclose(torch.as_tensor(sa[name]), torch.as_tensor(sb[name]),
                                          atol=1e-9), (kind, fusion, name)


def check_cross_barrier_eval_forward_and_state_dict_apply_pending_updates():
    ref, _, model, opt = _cross_barrier_run(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 0)
    x = torch.ones(2, 6, dtype=torch.float64)
    with torch.no_grad():
        model.eval()
        got = model(x)  # every layer's pre-hook applies its pending update first
    assert opt.pending_updates() == 0
    assert torch.allclose(got, ref(x).detach(), atol=1e-9)
    ref2, _, model2, opt2 = _cross_barrier_run(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 0)
    state = opt2.state_dict()
    assert opt2.pending_updates() == 0 and len(state["state"]) == len(list(model2.parameters()))
    assert all(torch.allclose(a, b, atol=1e-9) for a, b in zip(ref2.parameters(), model2.parameters()))


def check_cross_barrier_num_steps_last_step_is_a_barrier_and_zero_grad_is_deferred():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double()
    opt = bps.CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           named_parameters=model.named_parameters(), num_steps=2)
    x = torch.ones(3, 4, dtype=torch.float64)
    model(x).sum().backward()
    opt.step()
    assert opt.pending_updates() == 4
    opt.zero_grad()  # deferred: the pending gradients still carry the averages
    assert all(p.grad is not None for p in model.parameters())
    model(x).sum().backward()  # the forward applied the updates, then zeroed the grads
    assert all(p.grad is not None for p in model.parameters())
    opt.step()  # step 2 of num_steps=2: waits and applies everything
    assert opt.pending_updates() == 0
    # Gradient clipping: synchronize() after backward averages now, step() updates at once.
    opt.zero_grad()
    model(x * (bps.rank() + 1)).sum().backward()
    opt.synchronize()
    before = [p.detach().clone() for p in model.parameters()]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
    with opt.skip_synchronize():
        opt.step()
    assert opt.pending_updates() == 0
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def check_cross_barrier_refuses_closure_double_wrap_and_parameters_used_outside_their_module():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.side = nn.Linear(3, 3)
            self.head = nn.Linear(3, 1)

        def forward(self, x):  # side.weight used without side's forward (no pre-hook)
            return self.head(x @ self.side.weight.t())

    torch.manual_seed(0)
    model = Odd().double()
    opt = bps.CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           named_parameters=model.named_parameters())
    try:
        opt.step(lambda: 0.0)
        raise AssertionError("a closure should be refused")
    except ValueError as exc:
        assert "closure" in str(exc)
    try:
        bps.CrossBarrier(model, opt)
        raise AssertionError("wrapping a wrapped optimizer should be refused")
    except ValueError as exc:
        assert "already" in str(exc)
    x = torch.ones(2, 3, dtype=torch.float64)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    try:
        model(x).sum().backward()
        raise AssertionError("a parameter used outside its module went unnoticed")
    except RuntimeError as exc:
        assert "outside the forward of the module" in str(exc) and "side.weight" in str(exc)
    opt.synchronize()  # the job stays usable: every rank raised at the same point
    opt.zero_grad()
