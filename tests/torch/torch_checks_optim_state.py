"""broadcast_optimizer_state over every torch.optim optimizer (see torch_check_worker.py).

Rank 0 steps its optimizer (so it has state) and uses other option values; the other
ranks start fresh. After the broadcast, one identical step on every rank must give
bit-identical parameters, which proves state and options both arrived.
"""

import torch

import bpstrain.torch as bps

OPTIMIZERS = [
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("Adam", dict(lr=0.01, betas=(0.8, 0.9), amsgrad=False)),
    ("AdamW", dict(lr=0.01, amsgrad=True, maximize=False)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.01)),
    ("Adadelta", dict(lr=1.0)),
    ("Adamax", dict(lr=0.01)),
    ("ASGD", dict(lr=0.01)),
    ("NAdam", dict(lr=0.01)),
    ("RAdam", dict(lr=0.01)),
    ("RMSprop", dict(lr=0.01, momentum=0.9, centered=True)),
    ("Rprop", dict(lr=0.01)),
    ("Adafactor", dict(lr=0.01)),
]


def _run(opt_name, kwargs, device, wrap=False):
    r = bps.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(device)
    opt = getattr(torch.optim, opt_name)(model.parameters(), **kwargs)
    if wrap:
        opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    if r == 0:
        for step in range(2):
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.1 * (step + 1))
            if wrap:
                with opt.skip_synchronize():  # only rank 0 steps here: no collective
                    opt.step()
            else:
                opt.step()
        opt.param_groups[0]["lr"] = 0.005
    else:
        opt.param_groups[0]["lr"] = 123.0
        opt.param_groups[0]["weight_decay"] = 0.5
    bps.broadcast_optimizer_state(opt, root_rank=0)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.005, opt.param_groups[0]["lr"]
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    want = bps.broadcast_object([p.detach().cpu() for p in model.parameters()], root_rank=0)
    for p, w in zip(model.parameters(), want):
        assert torch.equal(p.detach().cpu(), w), (opt_name, p, w)


def check_broadcast_optimizer_state_every_optimizer(device="cpu"):
    done = []
    for name, kwargs in OPTIMIZERS:
        if hasattr(torch.optim, name):
            _run(name, kwargs, device)
            done.append(name)
    assert len(done) >= 11, done


def check_broadcast_optimizer_state_of_distributed_optimizer(device="cpu"):
    _run("Adam", dict(lr=0.01), device, wrap=True)


def check_broadcast_optimizer_state_lbfgs_and_sparse_adam():
    r = bps.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=3)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    if r == 0:
        opt.step(closure)
    bps.broadcast_optimizer_state(opt, root_rank=0)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    opt.step(closure)
    want = bps.broadcast_object(model.state_dict(), root_rank=0)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())

    emb = torch.nn.Embedding(10, 3, sparse=True)
    torch.manual_seed(0)
    torch.nn.init.normal_(emb.weight)
    sparse = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    if r == 0:
        emb(torch.tensor([1, 2])).sum().backward()
        sparse.step()
    bps.broadcast_optimizer_state(sparse, root_rank=0)
    bps.broadcast_parameters(emb.state_dict(), root_rank=0)
    sparse.zero_grad()
    emb(torch.tensor([2, 3])).sum().backward()
    sparse.step()
    want = bps.broadcast_object(emb.weight.detach(), root_rank=0)
    assert torch.equal(emb.weight.detach(), want)
