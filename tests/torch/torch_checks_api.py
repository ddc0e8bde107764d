"""Checks of the collective API, run inside a launched job (see torch_check_worker.py).

Functions take ``device`` so torch_checks_cuda.py reruns them on the GPU.
"""

import time

import numpy as np
import torch

import bpstrain.torch as bps
from bpstrain.errors import MismatchError

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64]


def _close(got, want, dtype):
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
    return torch.allclose(got.double().cpu(), want.double().cpu(), rtol=tol, atol=tol)


def check_push_pull_every_dtype(device="cpu"):
    r, n = bps.rank(), bps.size()
    base = torch.arange(6).reshape(2, 3)
    for dt in DTYPES:
        for shape_name, x in (("2x3", base + r), ("0d", torch.tensor(r + 1))):
            x = x.to(dt).to(device)
            tag = f"dtype.{device}.{dt}.{shape_name}"
            total = bps.push_pull(x, average=False, name=tag + ".sum")
            want = (base * n + n * (n - 1) // 2) if shape_name == "2x3" else torch.tensor(n * (n + 1) // 2)
            assert total.dtype == dt and total.shape == x.shape and total.device == x.device, tag
            assert torch.equal(total.cpu(), want.to(dt)), (tag, total, want)
            avg = bps.push_pull(x, average=True, name=tag + ".avg")
            if dt.is_floating_point:
                assert _close(avg, want.double() / n, dt), (tag, avg)
            else:  # integer averages floor-divide
                assert torch.equal(avg.cpu(), torch.div(want, n, rounding_mode="floor").to(dt)), (tag, avg)


def check_async_poll_inplace_noncontiguous(device="cpu"):
    r, n = bps.rank(), bps.size()
    x = torch.full((1000,), float(r), device=device)
    handle = bps.push_pull_async(x, average=False, name=f"async.{device}")
    deadline = time.monotonic() + 20
    while not bps.poll(handle):  # poll() itself is under test
        assert time.monotonic() < deadline, "poll never became True"
        time.sleep(0.001)
    out = bps.synchronize(handle)
    assert torch.equal(out, torch.full_like(x, n * (n - 1) / 2)) and torch.equal(x, torch.full_like(x, r))
    try:
        bps.synchronize(handle)
        raise AssertionError("second synchronize() should fail")
    except ValueError:
        pass
    assert bps.push_pull_inplace(x, name=f"inplace.{device}") is x
    assert torch.allclose(x, torch.full_like(x, (n - 1) / 2))
    y = (torch.arange(12.0, device=device).reshape(3, 4) * (r + 1)).t()
    bps.push_pull_inplace(y, average=False, name=f"noncontig.{device}")
    assert not y.is_contiguous()
    assert torch.equal(y, torch.arange(12.0, device=device).reshape(3, 4).t() * (n * (n + 1) // 2))


def check_broadcast_every_dtype(device="cpu"):
    r, n = bps.rank(), bps.size()
    root = n - 1
    for dt in DTYPES:
        x = (torch.arange(6).reshape(2, 3) + 10 * r).to(dt).to(device)
        want = (torch.arange(6).reshape(2, 3) + 10 * root).to(dt)
        got = bps.broadcast(x, root, name=f"bcast.{device}.{dt}")
        assert torch.equal(got.cpu(), want) and got.device == x.device, (dt, got)
        assert r == root or not torch.equal(x.cpu(), want), "broadcast() must not modify its input"
        bps.broadcast_(x, root, name=f"bcast_.{device}.{dt}")
        assert torch.equal(x.cpu(), want), (dt, x)
        s = torch.tensor(r, dtype=dt, device=device)
        bps.broadcast_(s, root, name=f"bcast0d.{device}.{dt}")
        assert s.shape == () and s.item() == root


def check_autograd_through_push_pull(device="cpu"):
    n = bps.size()
    x = torch.ones(4, device=device, requires_grad=True)
    y = bps.push_pull(x, average=False, name=f"autograd.sum.{device}")
    y.sum().backward()
    assert torch.equal(y.detach(), torch.full_like(x, n)) and torch.equal(x.grad, torch.full_like(x, n))
    x2 = torch.ones(4, device=device, requires_grad=True)
    bps.push_pull(x2, average=True, name=f"autograd.avg.{device}").sum().backward()
    assert torch.equal(x2.grad, torch.ones_like(x2))


def check_fp16_compression_and_bad_dtypes(device="cpu"):
    r, n = bps.rank(), bps.size()
    x = torch.full((5,), 1.5 + r, device=device)
    y = bps.push_pull(x, average=False, name=f"fp16.{device}", compression=bps.Compression.fp16)
    assert y.dtype == torch.float32 and torch.allclose(y, torch.full_like(x, 1.5 * n + n * (n - 1) / 2))
    small, ctx = bps.Compression.fp16.compress(torch.ones(2, dtype=torch.int32))
    assert small.dtype == torch.int32 and bps.Compression.fp16.decompress(small, ctx).dtype == torch.int32
    for bad in (torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.complex64)):
        try:
            bps.push_pull(bad.to(device), name="bad.dtype")
            raise AssertionError(f"{bad.dtype} should be refused")
        except ValueError as exc:
            assert "Received: dtype=" in str(exc)


def check_shape_mismatch_raises_everywhere_and_job_survives(device="cpu"):
    r, n = bps.rank(), bps.size()
    try:
        bps.push_pull(torch.ones(3 + r, device=device), name=f"mismatch.{device}")
        raise AssertionError("shape mismatch went unnoticed")
    except MismatchError as exc:
        assert isinstance(exc, RuntimeError) and f"mismatch.{device}" in str(exc)
    out = bps.push_pull(torch.ones(2, device=device), average=False, name=f"after.mismatch.{device}")
    assert torch.equal(out, torch.full_like(out, n))


def check_broadcast_object():
    r, n = bps.rank(), bps.size()
    obj = {"rank": r, "t": torch.arange(3) * r, "blob": "x" * (1000 * r), "none": None}
    got = bps.broadcast_object(obj, root_rank=n - 1)
    assert got["rank"] == n - 1 and torch.equal(got["t"], torch.arange(3) * (n - 1))
    assert got["blob"] == "x" * (1000 * (n - 1)) and got["none"] is None
    assert bps.broadcast_object(r * 7) == 0


def check_broadcast_parameters_state_dict_named_and_list():
    r = bps.rank()
    torch.manual_seed(r)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    for _ in range(r + 1):  # different running stats and num_batches_tracked per rank
        model(torch.randn(8, 4))
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    want = bps.broadcast_object(model.state_dict(), root_rank=0)
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key
    assert int(model[1].num_batches_tracked) == 1
    with torch.no_grad():
        for p in model.parameters():
            p.add_(r)
    bps.broadcast_parameters(model.named_parameters(), root_rank=0)
    assert all(torch.equal(p, want[k]) for k, p in model.named_parameters())
    extra = [torch.full((2,), float(r)), torch.tensor(r)]
    bps.broadcast_parameters(extra, root_rank=0)
    assert extra[0].sum() == 0 and extra[1] == 0
    try:
        bps.broadcast_parameters(5)
        raise AssertionError("an int is not a parameter collection")
    except ValueError:
        pass


def check_sparse_push_pull_of_embedding_gradients_equals_dense_on_touched_rows():
    r, n = bps.rank(), bps.size()
    emb = torch.nn.Embedding(500, 6, sparse=True)
    gen = torch.Generator().manual_seed(7 + r)
    ids = torch.randint(0, 500, (40,), generator=gen)
    ids[:5] = 3  # a shared row and duplicates
    weights = torch.randint(-3, 4, (40, 6), generator=gen).float()  # exact sums in any order
    (emb(ids) * weights).sum().backward()
    grad = emb.weight.grad
    assert grad.is_sparse
    result = bps.sparse_push_pull(grad, name="check.sparse.emb")
    dense = bps.push_pull(grad.to_dense(), name="check.sparse.dense")
    assert result.is_sparse and result.shape == grad.shape
    rows = result.indices()[0]
    all_ids = [bps.broadcast(ids.clone(), root_rank=k, name=f"check.sparse.ids{k}") for k in range(n)]
    assert torch.equal(rows, torch.unique(torch.cat(all_ids)))  # the union, nothing else
    assert torch.equal(result.values(), dense[rows])  # bit for bit with the dense average
    assert torch.equal(result.to_dense(), dense)


class _TwoTables(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(3)
        self.big = torch.nn.Embedding(20000, 16, sparse=sparse)   # 1.28 MB: its own operation
        self.small = torch.nn.Embedding(100, 4, sparse=sparse)    # fused with the head
        self.head = torch.nn.Linear(20, 1)

    def forward(self, ids, small_ids, use_big=True):
        big = self.big(ids).mean(1) if use_big else torch.zeros(ids.shape[0], 16)
        return self.head(torch.cat([big, self.small(small_ids).mean(1)], 1))


def check_distributed_optimizer_sends_sparse_embedding_gradients_as_rows():
    r, n = bps.rank(), bps.size()
    gen = torch.Generator().manual_seed(11 + r)
    grads = {}
    for sparse in (True, False):
        model = _TwoTables(sparse)
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + r)
            ids, small_ids = torch.randint(0, 20000, (8, 5), generator=g), torch.randint(0, 100, (8, 3), generator=g)
            opt.zero_grad()
            # Step 2: the last rank does not use the big table (it sends no rows).
            model(ids, small_ids, use_big=step < 2 or r != n - 1).pow(2).mean().backward()
            opt.synchronize()
            grads[(sparse, step)] = {k: (v.grad.to_dense() if v.grad.is_sparse else v.grad).clone()
                                     for k, v in model.named_parameters()}
            if sparse:
                assert model.big.weight.grad.is_sparse and model.small.weight.grad.is_sparse
            with opt.skip_synchronize():
                opt.step()
    for step in range(3):
        for k in grads[(True, step)]:
            a, b = grads[(True, step)][k], grads[(False, step)][k]
            if n == 2:  # two summands: the same bits in any order
                assert torch.equal(a, b), (k, (a - b).abs().max())
            else:
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (k, (a - b).abs().max())


def check_embedding_table_on_the_servers_matches_a_single_process_reference():
    from bpstrain._sparse import initial_rows
    from bpstrain.embedding_table import EmbeddingTable

    r, n = bps.rank(), bps.size()
    rows_total, width, lr, steps = 3000, 4, 0.5, 4
    for optimizer in ("sgd", "adagrad"):
        table = EmbeddingTable(f"check.table.{optimizer}", rows_total, width, optimizer=optimizer,
                               init_scale=0.05, seed=7)
        ref = {}  # the single-process replay: id -> row (and accumulator)
        acc = {}

        def ids_of(rank, step):
            g = np.random.default_rng(1000 * step + rank)
            return g.integers(0, rows_total, 30)

        for step in range(steps):
            mine = ids_of(r, step)
            got = table.pull(mine)
            for i in np.unique(np.concatenate([ids_of(k, step) for k in range(n)])):
                ref.setdefault(int(i), initial_rows([i], width, 0.05, 7)[0].astype(np.float64))
                acc.setdefault(int(i), np.zeros(width))
            np.testing.assert_allclose(got, np.stack([ref[int(i)] for i in mine]), rtol=1e-6, atol=1e-7)
            table.push(mine, np.full((30, width), r + 1, np.float32), lr=lr)  # duplicates sum
            total = {}
            for k in range(n):
                for i in ids_of(k, step):
                    total[int(i)] = total.get(int(i), 0.0) + (k + 1)
            for i, g in total.items():
                g = g / n
                if optimizer == "sgd":
                    ref[i] = ref[i] - lr * g
                else:
                    acc[i] = acc[i] + g * g
                    ref[i] = ref[i] - lr * g / (np.sqrt(acc[i]) + 1e-10)
        every = np.arange(rows_total)
        final = table.pull(every if r == 0 else every[:0])
        if r == 0:
            touched = np.array(sorted(ref))
            np.testing.assert_allclose(final[touched], np.stack([ref[int(i)] for i in touched]),
                                       rtol=1e-5, atol=1e-6)
            untouched = np.setdiff1d(every, touched)
            np.testing.assert_array_equal(final[untouched], initial_rows(untouched, width, 0.05, 7))
