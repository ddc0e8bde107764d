"""bpstrain.torch.ServerEmbedding / ServerEmbeddingBag in a launched job (see
torch_check_worker.py): the layers, whose table only the servers hold, train exactly as
one process training a local ``nn.EmbeddingBag`` on every rank's batch with the gradient
averaged over ranks (the table's initial rows rebuilt here from the servers' seed)."""

import numpy as np
import torch
import torch.nn.functional as F

import bpstrain.torch as bps
from bpstrain._sparse import initial_rows

ROWS, WIDTH, SCALE, SEED, LR, STEPS = 400, 4, 0.1, 11, 0.3, 4


def _batch(rank, step):
    g = np.random.default_rng(100 * step + rank)
    ids = torch.from_numpy(g.zipf(1.3, 24) % ROWS)
    coef = torch.from_numpy(g.standard_normal((6, WIDTH)).astype(np.float32))
    return ids, torch.arange(0, 24, 4), coef


def _train_against_reference(layer, optimizer, lookup):
    """Steps ``layer`` (lookup(module_or_weight, ids, offsets)) next to a local replay;
    returns the largest difference seen."""
    r, n = bps.rank(), bps.size()
    ref = torch.nn.Parameter(torch.from_numpy(initial_rows(np.arange(ROWS), WIDTH, SCALE, SEED)))
    ref_opt = (torch.optim.SGD([ref], lr=LR) if optimizer == "sgd"
               else torch.optim.Adagrad([ref], lr=LR, eps=1e-10))
    worst = 0.0
    for step in range(STEPS):
        ids, offsets, coef = _batch(r, step)
        out = lookup(layer, ids, offsets)
        want = lookup(ref, ids, offsets).detach()
        worst = max(worst, float((out.detach() - want).abs().max()))
        torch.testing.assert_close(out.detach(), want, rtol=1e-5, atol=1e-6)
        (out * coef[: out.shape[0]]).sum().backward()  # pushes this rank's rows' gradients
        with torch.no_grad():  # an evaluation pull in between (every rank): no push
            layer.eval()
            lookup(layer, ids[:4], offsets[:1])
            layer.train()
        ref_opt.zero_grad()
        total = sum((lookup(ref, *_batch(k, step)[:2]) * _batch(k, step)[2][: out.shape[0]]).sum()
                    for k in range(n))
        (total / n).backward()
        ref_opt.step()
    layer.synchronize()
    every = np.arange(ROWS)
    final = layer.table.pull(every if r == 0 else every[:0])
    if r == 0:
        torch.testing.assert_close(torch.from_numpy(final), ref.detach(), rtol=1e-5, atol=1e-6)
    return worst


def check_server_embedding_bag_with_sgd_trains_like_one_process():
    bag = bps.ServerEmbeddingBag(ROWS, WIDTH, name="check.emb.bag", mode="mean", lr=LR, init_scale=SCALE,
                                 seed=SEED)

    def lookup(layer, ids, offsets):
        if isinstance(layer, torch.Tensor):
            return F.embedding_bag(ids, layer, offsets, mode="mean")
        return layer(ids, offsets)

    return _train_against_reference(bag, "sgd", lookup)


def check_server_embedding_with_adagrad_trains_like_one_process():
    emb = bps.ServerEmbedding(ROWS, WIDTH, name="check.emb.plain", optimizer="adagrad", lr=LR,
                              init_scale=SCALE, seed=SEED)

    def lookup(layer, ids, offsets):
        ids = ids.view(-1, 4)
        if isinstance(layer, torch.Tensor):
            return F.embedding(ids, layer).sum(1)
        return layer(ids).sum(1)

    return _train_against_reference(emb, "adagrad", lookup)
