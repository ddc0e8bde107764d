"""Checks of Horovod's calls in bpstrain.torch (mpi_ops, SyncBatchNorm), on every rank."""

import torch

import bpstrain.torch as hvd


def check_allreduce_average_sum_and_scaling():
    rank, size = hvd.rank(), hvd.size()
    x = torch.full((4,), float(rank))
    mean = (size - 1) / 2
    assert torch.allclose(hvd.allreduce(x, name="hvd.a"), torch.full((4,), mean))
    assert torch.allclose(hvd.allreduce(x, op=hvd.Average), torch.full((4,), mean))
    total = float(sum(range(size)))
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, name="hvd.s"), torch.full((4,), total))
    assert torch.equal(hvd.allreduce(x, average=False), torch.full((4,), total))
    scaled = hvd.allreduce(x + 1, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert torch.equal(scaled, torch.full((4,), total + size)), scaled
    assert torch.equal(x, torch.full((4,), float(rank)))  # allreduce leaves its input alone
    half = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert half.dtype == torch.float32 and torch.allclose(half, torch.full((4,), mean))


def check_allreduce_in_place_and_async():
    rank, size = hvd.rank(), hvd.size()
    x = torch.full((3,), float(rank + 1))
    assert hvd.allreduce_(x, op=hvd.Sum, name="hvd.ip") is x
    assert torch.equal(x, torch.full((3,), float(size * (size + 1) / 2)))
    h = hvd.allreduce_async(torch.full((3,), float(rank)), op=hvd.Sum, postscale_factor=3.0)
    assert torch.equal(hvd.synchronize(h), torch.full((3,), 3.0 * sum(range(size))))
    y = torch.ones(2)
    h = hvd.allreduce_async_(y, prescale_factor=4.0, name="hvd.ip.async")
    assert hvd.synchronize(h) is y and torch.equal(y, torch.full((2,), 4.0))


def check_allreduce_is_differentiable():
    size = hvd.size()
    x = torch.ones(3, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum, name="hvd.grad").sum().backward()
    assert torch.equal(x.grad, torch.full((3,), float(size))), x.grad


def check_allgather_with_different_first_dims():
    rank, size = hvd.rank(), hvd.size()
    x = torch.full((rank + 1, 2), rank, dtype=torch.int32)
    out = hvd.allgather(x, name="hvd.ag")
    expect = torch.cat([torch.full((r + 1, 2), r, dtype=torch.int32) for r in range(size)])
    assert torch.equal(out, expect), out
    again = hvd.allgather(torch.full((2, 2), rank, dtype=torch.int32), name="hvd.ag")  # re-declared
    assert torch.equal(again, torch.cat([torch.full((2, 2), r, dtype=torch.int32) for r in range(size)]))


def check_allgather_gradient_is_the_sum_of_the_ranks_rows():
    rank, size = hvd.rank(), hvd.size()
    x = torch.full((2, 3), float(rank), requires_grad=True)
    out = hvd.allgather(x, name="hvd.ag.grad")
    weights = torch.arange(out.shape[0], dtype=torch.float32).unsqueeze(1)
    (out * weights).sum().backward()  # every rank the same loss: gradient = size * weights
    assert torch.equal(x.grad, (size * weights[rank * 2:rank * 2 + 2]).expand(2, 3)), x.grad


def check_barrier_and_broadcast_():
    rank = hvd.rank()
    hvd.barrier()
    t = torch.full((3,), float(rank))
    assert hvd.broadcast_(t, root_rank=hvd.size() - 1, name="hvd.b_") is t
    assert torch.all(t == hvd.size() - 1), t


def check_distributed_optimizer_takes_op():
    size = hvd.size()
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), op=hvd.Sum)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # each rank's gradient is ones: summed over ranks
    assert torch.allclose(model.weight, torch.full((1, 2), 1.0 - size)), model.weight


def _bn_input(rank):
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(4, 3, 5, generator=g) * (rank + 1) + rank


def check_sync_batch_norm_matches_batch_norm_on_the_whole_batch():
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    sync = hvd.SyncBatchNorm(3)
    with torch.no_grad():
        sync.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        sync.bias.copy_(torch.tensor([0.0, -1.0, 3.0]))
    ref = torch.nn.BatchNorm1d(3)
    ref.load_state_dict(sync.state_dict())
    x = _bn_input(rank).requires_grad_()
    whole = torch.cat([_bn_input(r) for r in range(size)]).requires_grad_()
    out = sync(x)
    expect = ref(whole)
    rows = slice(rank * 4, rank * 4 + 4)
    assert torch.allclose(out, expect[rows], atol=1e-5), (out - expect[rows]).abs().max()
    weights = torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape)
    (out * weights).sum().backward()  # the whole batch's loss is the sum of the ranks' losses
    (expect * torch.cat([weights] * size)).sum().backward()
    assert torch.allclose(x.grad, whole.grad[rows], atol=1e-4), (x.grad - whole.grad[rows]).abs().max()
    # Parameter gradients are per rank (DDP/DistributedOptimizer average them); summed they match.
    wsum = hvd.allreduce(sync.weight.grad, op=hvd.Sum, name="hvd.bn.w")
    assert torch.allclose(wsum, ref.weight.grad, atol=1e-4), (wsum, ref.weight.grad)
    assert torch.allclose(sync.running_mean, ref.running_mean, atol=1e-6)
    assert torch.allclose(sync.running_var, ref.running_var, atol=1e-5)
    sync.eval()
    assert torch.allclose(sync(x), ref.eval()(x), atol=1e-6)


def check_convert_sync_batchnorm_keeps_state():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2))
    model[1].running_mean.fill_(0.5)
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(converted[1], hvd.SyncBatchNorm)
    assert torch.all(converted[1].running_mean == 0.5)
    converted(torch.randn(2, 1, 3, 3)).sum().backward()


def check_unsupported_horovod_calls_raise_naming_the_alternative():
    cases = [(lambda: hvd.allreduce(torch.ones(1), op=hvd.Adasum), NotImplementedError, "Average"),
             (lambda: hvd.allreduce(torch.ones(1), op=hvd.Max), NotImplementedError, "gloo"),
             (lambda: hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum), ValueError, "supersedes"),
             (lambda: hvd.join(), NotImplementedError, "barrier"),
             (lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1),
                                               op=hvd.Adasum), NotImplementedError, "Average")]
    for call, kind, words in cases:
        try:
            call()
        except kind as exc:
            assert words in str(exc), str(exc)
        else:
            raise AssertionError(f"expected {kind.__name__} mentioning {words!r}")
