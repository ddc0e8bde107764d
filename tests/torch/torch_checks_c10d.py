"""Checks of the ``torch.distributed`` backend "bpstrain", run on every rank of a launched job.

The default group is ``init_process_group("bpstrain")`` with no other argument (the
rendezvous comes from BytePS's variables); a gloo group of the same job is the reference.
"""

import copy

import torch
import torch.distributed as dist

import bpstrain.torch as bps
from bpstrain.torch import process_group

_gloo = []


def _init():
    if not dist.is_initialized():
        dist.init_process_group("bpstrain")
        _gloo.append(dist.new_group(backend="gloo"))
    return dist.get_rank(), dist.get_world_size()


def check_init_process_group_takes_ranks_from_bpstrain():
    rank, size = _init()
    assert dist.get_backend() == "bpstrain", dist.get_backend()
    assert (rank, size) == (bps.rank(), bps.size()), (rank, size, bps.rank(), bps.size())
    assert size >= 2, size


def check_all_reduce_sum_and_avg():
    rank, size = _init()
    t = torch.arange(5, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    expect = torch.arange(5, dtype=torch.float32) * sum(range(1, size + 1))
    assert torch.equal(t, expect), (t, expect)
    t = torch.full((3, 2), float(rank), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.allclose(t, torch.full((3, 2), (size - 1) / 2, dtype=torch.float64)), t
    i = torch.tensor([rank + 10, -rank], dtype=torch.int64)
    dist.all_reduce(i)
    assert i.tolist() == [sum(r + 10 for r in range(size)), -sum(range(size))], i


def check_many_same_size_all_reduces_in_flight_keep_their_values():
    rank, size = _init()
    tensors = [torch.full((1000,), float(k * 100 + rank)) for k in range(6)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for w in works:
        w.wait()
    for k, t in enumerate(tensors):
        expect = float(size * k * 100 + sum(range(size)))
        assert torch.all(t == expect), (k, t[:3], expect)


def check_broadcast_from_every_root():
    rank, size = _init()
    for root in range(size):
        t = torch.full((4,), float(rank * 7 + 1))
        dist.broadcast(t, src=root)
        assert torch.all(t == root * 7 + 1), (root, t)


def check_all_gather_and_into_tensor():
    rank, size = _init()
    outs = [torch.zeros(2, 3) for _ in range(size)]
    dist.all_gather(outs, torch.full((2, 3), float(rank)))
    assert all(torch.all(o == r) for r, o in enumerate(outs)), outs
    flat = torch.zeros(size * 4, dtype=torch.int32)
    dist.all_gather_into_tensor(flat, torch.arange(4, dtype=torch.int32) + 10 * rank)
    expect = torch.cat([torch.arange(4, dtype=torch.int32) + 10 * r for r in range(size)])
    assert torch.equal(flat, expect), flat
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(size)], objs


def check_reduce_scatter_both_forms():
    rank, size = _init()
    out = torch.zeros(3)
    dist.reduce_scatter(out, [torch.full((3,), float(r * 10 + rank)) for r in range(size)])
    assert torch.all(out == size * rank * 10 + sum(range(size))), out
    big = torch.arange(size * 2, dtype=torch.float32) + rank
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, big, op=dist.ReduceOp.AVG)
    expect = torch.arange(size * 2, dtype=torch.float32)[rank * 2:rank * 2 + 2] + (size - 1) / 2
    assert torch.allclose(out, expect), (out, expect)


def check_reduce_gather_scatter():
    rank, size = _init()
    t = torch.ones(3) * (rank + 1)
    dist.reduce(t, dst=0)
    if rank == 0:
        assert torch.all(t == sum(range(1, size + 1))), t
    gathered = [torch.zeros(2) for _ in range(size)] if rank == size - 1 else None
    dist.gather(torch.full((2,), float(rank)), gathered, dst=size - 1)
    if rank == size - 1:
        assert all(torch.all(g == r) for r, g in enumerate(gathered)), gathered
    out = torch.zeros(2)
    pieces = [torch.full((2,), float(r * 3)) for r in range(size)] if rank == 0 else None
    dist.scatter(out, pieces, src=0)
    assert torch.all(out == rank * 3), out


def check_barrier_and_async_work():
    _init()
    dist.barrier()
    t = torch.ones(8)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    fut.wait()
    assert work.is_completed() and torch.all(t == dist.get_world_size()), t


def check_unsupported_collectives_raise_naming_gloo():
    rank, size = _init()
    for call in (lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.MAX),
                 lambda: dist.all_to_all_single(torch.zeros(size), torch.ones(size)),
                 lambda: dist.send(torch.ones(1), (rank + 1) % size)):
        try:
            call()
        except NotImplementedError as exc:
            assert "new_group(backend='gloo')" in str(exc), str(exc)
        else:
            raise AssertionError("expected NotImplementedError")
    t = torch.full((1,), float(rank))  # the advertised way out works
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_gloo[0])
    assert t.item() == size - 1, t


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batches(rank, steps=6, per_rank=8):
    g = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    return [(torch.randn(per_rank, 6, generator=g), torch.randint(0, 3, (per_rank,), generator=g))
            for _ in range(steps)]


def _train(model, batches, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_unmodified_ddp_matches_gloo_ddp_and_one_big_batch():
    rank, size = _init()
    base = _model()
    init = [p.detach().clone() for p in base.parameters()]
    ours = _train(torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001),
                  _batches(rank))
    gloo = _train(torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=_gloo[0],
                                                            bucket_cap_mb=0.001), _batches(rank))
    # One process, every rank's batch at once: the mean loss over the big batch has the
    # averaged gradient (equal batch sizes).
    every = [_batches(r) for r in range(size)]
    big = [(torch.cat([every[r][s][0] for r in range(size)]), torch.cat([every[r][s][1] for r in range(size)]))
           for s in range(len(every[0]))]
    single = _train(copy.deepcopy(base), big)
    alone = _train(copy.deepcopy(base), _batches(rank))  # what no averaging would give
    for a, b, c, d, p0 in zip(ours, gloo, single, alone, init):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
        assert torch.allclose(a, c, atol=1e-5), (a - c).abs().max()
        assert not torch.allclose(a, d, atol=1e-3) and not torch.allclose(a, p0, atol=1e-3)


def check_ddp_buckets_get_front_layers_first():
    """The bucket holding the first layer is queued last with the highest priority."""
    rank, _ = _init()
    model = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.0001)
    first_weight = next(model.parameters()).numel()
    total = sum(p.numel() for p in model.parameters())
    seen = []
    real = process_group.ops.push_pull_async_inplace

    def spy(tensor, average=True, name=None, version=0, priority=0):
        seen.append((priority, tensor.numel()))
        return real(tensor, average, name, version, priority)

    process_group.ops.push_pull_async_inplace = spy
    try:
        for x, y in _batches(rank, steps=3):  # DDP rebuilds its buckets after step 1
            seen.clear()
            torch.nn.functional.cross_entropy(model(x), y).backward()
    finally:
        process_group.ops.push_pull_async_inplace = real
    assert len(seen) >= 3 and sum(n for _, n in seen) == total, seen  # every gradient, in buckets
    priorities = [p for p, _ in seen]
    assert priorities == sorted(priorities) and len(set(priorities)) == len(priorities), seen
    assert seen[-1][1] == first_weight, (seen, first_weight)  # front layer: queued last, goes first
