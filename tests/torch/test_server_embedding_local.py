"""bpstrain.torch.ServerEmbedding(Bag) and EmbeddingTable in one process (no servers: the
table lives in this process, only the rows touched) and their error paths; the launched jobs are in
test_torch_jobs.py (torch_checks_embedding.py)."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import bpstrain.torch as bps
from bpstrain._sparse import initial_rows


pytestmark = pytest.mark.usefixtures("standalone_engine")  # rank 0 of 1: the table lives here


@pytest.mark.timeout(30)
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_a_single_process_table_trains_like_a_local_embedding_bag(optimizer, prefetch):
    rows, width, lr = 50, 3, 0.2
    bag = bps.ServerEmbeddingBag(rows, width, name=f"local.{optimizer}.{prefetch}", mode="sum", optimizer=optimizer,
                                 lr=lr, init_scale=0.5, seed=4)
    ref = torch.nn.Parameter(torch.from_numpy(initial_rows(np.arange(rows), width, 0.5, 4)))
    opt = {"sgd": lambda: torch.optim.SGD([ref], lr=lr),
           "adagrad": lambda: torch.optim.Adagrad([ref], lr=lr, eps=1e-10),
           "adam": lambda: torch.optim.SparseAdam([ref], lr=lr)}[optimizer]()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, rows, (12,), generator=g) for _ in range(5)]
    for step, ids in enumerate(batches):
        offsets = torch.tensor([0, 5, 9])
        out = bag(ids, offsets)
        if prefetch and step + 1 < len(batches):  # taken by the next forward, after this push
            bag.prefetch(batches[step + 1])
        want = F.embedding_bag(ids, ref, offsets, mode="sum", sparse=optimizer == "adam")
        torch.testing.assert_close(out, want.detach(), rtol=1e-6, atol=1e-6)
        (out ** 2).sum().backward()
        opt.zero_grad()
        (want ** 2).sum().backward()
        opt.step()
    torch.testing.assert_close(torch.from_numpy(bag.table.pull(np.arange(rows))), ref.detach(),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(30)
def test_an_untouched_table_takes_no_memory_and_evaluation_does_not_update():
    emb = bps.ServerEmbedding(1 << 40, 64, name="local.huge", lr=1.0)  # 256 TiB if it were dense
    ids = torch.tensor([[3, 1 << 39]])
    before = emb(ids).detach().clone()
    emb.eval()
    with torch.no_grad():
        assert torch.equal(emb(ids), before)
    emb.train()
    emb(ids).sum().backward()
    assert torch.allclose(emb(ids), before - 1.0)


@pytest.mark.timeout(30)
def test_bad_arguments_and_ids_raise_clear_errors():
    with pytest.raises(ValueError, match="mode must be"):
        bps.ServerEmbeddingBag(10, 2, name="bad.mode", mode="median")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        bps.ServerEmbedding(10, 2, name="bad.opt", optimizer="adamw")
    with pytest.raises(ValueError, match=r"betas two numbers in \[0, 1\)"):
        bps.ServerEmbedding(10, 2, name="bad.betas", optimizer="adam", betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr must be"):
        bps.ServerEmbedding(10, 2, name="bad.lr", lr=-1.0)
    emb = bps.ServerEmbedding(10, 2, name="bad.ids")
    with pytest.raises(ValueError, match=r"row ids must be in \[0, 10\)"):
        emb(torch.tensor([1, 10]))
    with pytest.raises(TypeError, match="integer ids"):
        emb(torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"must be \(len\(ids\), 2\)"):
        emb.table.push([1], np.zeros((1, 3), np.float32), lr=0.1)
    out = emb(torch.tensor([1, 2]))
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second backward before the next forward"):
        out.sum().backward()


@pytest.mark.timeout(30)
def test_a_prefetch_answer_from_the_servers_is_checked_before_its_rows_are_used(monkeypatch):
    """take() trusts nothing the servers sent: rows of ids not asked, or ids left without
    a row, raise; the push's refresh overrides what the prefetch's answer said."""
    from bpstrain import _sparse, embedding_table
    from bpstrain.embedding_table import EmbeddingTable, Prefetch

    monkeypatch.setattr(EmbeddingTable, "_local", property(lambda self: None))  # as if servers kept it
    table = EmbeddingTable("checked.prefetch", 100, 2)
    blobs = {}
    monkeypatch.setattr(embedding_table.engine, "synchronize", lambda handle: blobs[handle])

    def started(answer, refresh=b""):
        ahead = Prefetch(np.array([3, 5, 8]), None, after=1)
        ahead.shards = [(np.arange(3), 7)]
        ahead.refresh = [refresh]
        blobs[7] = answer
        return ahead

    rows = lambda ids, v: _sparse.encode(np.array(ids), np.full((len(ids), 2), v, np.float32)).tobytes()
    got = table.take(started(rows([3, 5, 8], 1.0), refresh=rows([5], 2.0)))
    np.testing.assert_array_equal(got, [[1, 1], [2, 2], [1, 1]])
    got = table.take(started(rows([3, 8], 1.0), refresh=rows([5], 2.0)))  # held back, sent with the push
    np.testing.assert_array_equal(got, [[1, 1], [2, 2], [1, 1]])
    with pytest.raises(ValueError, match="rows that were not asked for"):
        table.take(started(rows([3, 4, 5, 8], 1.0)))
    with pytest.raises(ValueError, match="left 1 rows of a prefetch unanswered"):
        table.take(started(rows([3, 8], 1.0)))
    with pytest.raises(ValueError, match="not ascending"):
        table.take(started(rows([8, 3], 1.0)))


def test_a_state_dict_warns_once_that_the_table_is_not_in_it():
    emb = bps.ServerEmbeddingBag(10, 2, name="unsaved")
    model = torch.nn.Sequential(emb, torch.nn.Linear(2, 1))
    with pytest.warns(UserWarning, match="'unsaved': the table's rows .* are not saved"):
        state = model.state_dict()
    assert set(state) == {"1.weight", "1.bias"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.state_dict()  # once per layer
