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


def _train_against_reference(layer, optimizer, lookup, prefetch=False):
    """Steps ``layer`` (lookup(module_or_weight, ids, offsets)) next to a local replay;
    returns the largest difference seen. With ``prefetch``, each step's forward is
    followed by ``layer.prefetch`` of the next step's ids (pulled once the push starts,
    kept across the evaluation forward in between)."""
    r, n = bps.rank(), bps.size()
    ref = torch.nn.Parameter(torch.from_numpy(initial_rows(np.arange(ROWS), WIDTH, SCALE, SEED)))
    ref_opt = {"sgd": lambda: torch.optim.SGD([ref], lr=LR),
               "adagrad": lambda: torch.optim.Adagrad([ref], lr=LR, eps=1e-10),
               "adam": lambda: torch.optim.SparseAdam([ref], lr=LR)}[optimizer]()
    worst = 0.0
    for step in range(STEPS):
        ids, offsets, coef = _batch(r, step)
        out = lookup(layer, ids, offsets)
        want = lookup(ref, ids, offsets).detach()
        worst = max(worst, float((out.detach() - want).abs().max()))
        torch.testing.assert_close(out.detach(), want, rtol=1e-5, atol=1e-6)
        if prefetch:
            layer.prefetch(_batch(r, step + 1)[0])
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


def _bag_lookup(mode, sparse=False):
    def lookup(layer, ids, offsets):
        if isinstance(layer, torch.Tensor):  # the reference
            return F.embedding_bag(ids, layer, offsets, mode=mode, sparse=sparse)
        return layer(ids, offsets)

    return lookup


def _plain_lookup(layer, ids, offsets):
    """ServerEmbedding (or the reference weight) over ids in bags of 4, summed."""
    ids = ids.view(-1, 4)
    if isinstance(layer, torch.Tensor):
        return F.embedding(ids, layer).sum(1)
    return layer(ids).sum(1)


def check_server_embedding_bag_with_sgd_trains_like_one_process():
    bag = bps.ServerEmbeddingBag(ROWS, WIDTH, name="check.emb.bag", mode="mean", lr=LR, init_scale=SCALE,
                                 seed=SEED)
    return _train_against_reference(bag, "sgd", _bag_lookup("mean"))


def check_prefetched_server_embedding_bag_with_sgd_trains_like_one_process():
    bag = bps.ServerEmbeddingBag(ROWS, WIDTH, name="check.emb.bag.ahead", mode="mean", lr=LR, init_scale=SCALE,
                                 seed=SEED)
    return _train_against_reference(bag, "sgd", _bag_lookup("mean"), prefetch=True)


def check_server_embedding_bag_with_adam_trains_like_sparse_adam():
    """Adam on the servers against torch.optim.SparseAdam on the averaged sparse gradient:
    moments of the touched rows only, bias correction by the table's step count."""
    bag = bps.ServerEmbeddingBag(ROWS, WIDTH, name="check.emb.adam", mode="sum", optimizer="adam", lr=LR,
                                 init_scale=SCALE, seed=SEED)
    return _train_against_reference(bag, "adam", _bag_lookup("sum", sparse=True))


def check_server_embedding_with_adagrad_trains_like_one_process():
    emb = bps.ServerEmbedding(ROWS, WIDTH, name="check.emb.plain", optimizer="adagrad", lr=LR,
                              init_scale=SCALE, seed=SEED)

    return _train_against_reference(emb, "adagrad", _plain_lookup)


def check_prefetched_server_embedding_with_adagrad_trains_like_one_process():
    emb = bps.ServerEmbedding(ROWS, WIDTH, name="check.emb.plain.ahead", optimizer="adagrad", lr=LR,
                              init_scale=SCALE, seed=SEED)

    return _train_against_reference(emb, "adagrad", _plain_lookup, prefetch=True)


def check_a_prefetch_during_the_push_gets_the_rows_that_push_changed():
    """Rank 0 prefetches while the last rank has not pushed yet (it waits 0.5 s), so the
    servers send the rows rank 0 pushed later, with the push's answer, and the rows the
    last rank pushes too: every rank's prefetched rows equal a pull after the push."""
    import time

    from bpstrain.embedding_table import EmbeddingTable

    r, n = bps.rank(), bps.size()
    table = EmbeddingTable("check.emb.prefetch", 50, 3, optimizer="sgd", init_scale=0.5, seed=9)
    ids = np.array([1, 2, 3, 10 + r, 20])  # 1-3 and 20: every rank's; 10+r: its own
    table.pull(ids)
    if r == n - 1:
        time.sleep(0.5)
    table.push_async(ids, np.full((5, 3), r + 1.0, np.float32), lr=0.1)
    ahead = table.prefetch(np.array([2, 3, 4, 10, 10 + r, 11, 30, 2]))  # duplicates, untouched rows
    got = table.take(ahead)
    assert not table._unwaited and ahead.refresh is not None  # take waited for the push
    if r == 0:  # the round was still open: the rows it changed came with its answer
        assert any(len(blob) for blob in ahead.refresh), ahead.refresh
    want = table.pull(np.array([2, 3, 4, 10, 10 + r, 11, 30, 2]))
    np.testing.assert_array_equal(got, want)
    initial = initial_rows(np.array([2, 4, 30]), 3, 0.5, 9)
    mean = np.float32(sum(k + 1.0 for k in range(n)) / n)
    np.testing.assert_allclose(got[[0, 2, 6]], initial - np.float32(0.1) * np.array([[mean], [0], [0]], np.float32),
                               rtol=1e-6)


def _assert_refused(call, words):
    """``call()`` raises a RuntimeError that says ``words``."""
    try:
        call()
    except RuntimeError as e:
        assert words in str(e), e
        return
    raise AssertionError(f"accepted, though it should be refused ({words})")


def check_a_prefetch_refuses_an_earlier_push_not_waited_for():
    from bpstrain.embedding_table import EmbeddingTable

    table = EmbeddingTable("check.emb.prefetch.order", 50, 3)
    first = table.push_async(np.array([1]), np.ones((1, 3), np.float32), lr=0.1)
    ahead = table.prefetch(np.array([1, 2]))
    _assert_refused(lambda: table.prefetch(np.array([3])), "second prefetch")
    table.discard(ahead)
    table.wait(first)
    second = table.push_async(np.array([1]), np.ones((1, 3), np.float32), lr=0.1)
    third = table.push_async(np.array([2]), np.ones((1, 3), np.float32), lr=0.1)
    _assert_refused(lambda: table.prefetch(np.array([1])), "earlier push")
    table.wait(second)
    table.wait(third)
    np.testing.assert_allclose(table.take(table.prefetch(np.array([1, 2]))), [[-0.2] * 3, [-0.1] * 3], rtol=1e-6)


def check_adam_counts_every_step_also_on_shards_without_rows():
    """Step 1 touches only even ids, step 2 only odd ones: with two servers one shard gets
    no rows at step 1, and its bias correction must still be that of step 2."""
    from bpstrain.embedding_table import EmbeddingTable

    r, n = bps.rank(), bps.size()
    table = EmbeddingTable("check.emb.adam.shards", 20, 2, optimizer="adam", init_scale=0.5, seed=5)
    ref = torch.nn.Parameter(torch.from_numpy(initial_rows(np.arange(20), 2, 0.5, 5)))
    opt = torch.optim.SparseAdam([ref], lr=0.1)
    for ids in (np.array([0, 2, 4]), np.array([1, 3, 5])):
        grads = np.full((3, 2), r + 1.0, np.float32)
        table.push(ids, grads, lr=0.1)
        total = sum(np.full((3, 2), k + 1.0, np.float32) for k in range(n)) * np.float32(1.0 / n)
        ref.grad = torch.sparse_coo_tensor(torch.from_numpy(ids)[None], torch.from_numpy(total), (20, 2))
        opt.step()
    got = table.pull(np.arange(6))
    torch.testing.assert_close(torch.from_numpy(got), ref.detach()[:6], rtol=1e-6, atol=1e-7)
