"""CUDA checks (see torch_check_worker.py); the tests set BYTEPS_PARTITION_BYTES=1 MiB so
tensors of a few MiB are staged in several chunks. Workers may share one GPU."""

import copy

import torch
from torch import nn

import bpstrain.torch as bps
import torch_checks_api as api
import torch_checks_compression as compression
import torch_checks_optim_state as optim_state
import torch_checks_training as training
from bpstrain.errors import MismatchError
from bpstrain.torch import _cuda
from bpstrain.torch.parallel import DistributedDataParallel


def _device():
    torch.cuda.set_device(bps.local_rank() % torch.cuda.device_count())
    return "cuda"


def check_cuda_push_pull_every_dtype():
    api.check_push_pull_every_dtype(_device())


def check_cuda_async_poll_inplace_noncontiguous():
    api.check_async_poll_inplace_noncontiguous(_device())


def check_cuda_broadcast_every_dtype():
    api.check_broadcast_every_dtype(_device())


def check_cuda_autograd_and_fp16():
    api.check_autograd_through_push_pull(_device())
    api.check_fp16_compression_and_bad_dtypes("cuda")


def check_cuda_compression_matches_numpy_reference():
    # The CUDA compressors encode on the GPU; every rank's answer must still equal the
    # numpy replay of the whole round (workers' and servers' error feedback included).
    _device()
    compression.check_byte_codecs_match_numpy_reference("cuda")
    compression.check_randomk_matches_numpy("cuda")
    compression.check_powersgd_matches_numpy("cuda")


def check_cuda_shape_mismatch():
    api.check_shape_mismatch_raises_everywhere_and_job_survives(_device())


def check_cuda_large_tensors_are_chunked_and_exact():
    r, n = bps.rank(), bps.size()
    _device()
    for dt in (torch.float32, torch.bfloat16, torch.int64, torch.float16):
        x = (torch.arange(3_000_001, device="cuda") % 7 + r).to(dt)
        assert len(_cuda.chunk_plan("x", x, bps.ops._runtime().chunk_bytes)) > 2
        want = ((torch.arange(3_000_001, device="cuda") % 7) * n + n * (n - 1) // 2).to(dt)
        got = bps.push_pull(x, average=False, name=f"big.{dt}")
        assert torch.equal(got, want), dt
        bps.push_pull_inplace(x, average=False, name=f"big.inplace.{dt}")
        assert torch.equal(x, want), dt
        b = bps.broadcast(x.reshape(1000, -1) if x.numel() % 1000 == 0 else x + r, 0,
                          name=f"big.bcast.{dt}")
        assert torch.equal(b, want), dt


def check_cpu_on_one_rank_cuda_on_another_raises():
    r, n = bps.rank(), bps.size()
    device = "cpu" if r == 0 else _device()
    for numel, tag in ((10, "small"), (1_000_000, "chunked")):
        try:
            bps.push_pull(torch.ones(numel, device=device), name=f"mixed.{tag}")
            raise AssertionError(f"CPU/CUDA mix went unnoticed ({tag})")
        except MismatchError as exc:
            assert "device" in str(exc) or "CUDA" in str(exc), exc
    out = bps.push_pull(torch.ones(3, device=_device()), average=False, name="after.mixed")
    assert torch.equal(out.cpu(), torch.full((3,), float(n)))


def check_cuda_chunked_layout_mismatch_raises():
    r, n = bps.rank(), bps.size()
    per_chunk = bps.ops._runtime().chunk_bytes // 4
    cases = {"count": (per_chunk * (2 + r),), "shape": (per_chunk * 4 // (r + 1), r + 1)}
    for tag, shape in cases.items():
        try:
            bps.push_pull(torch.ones(shape, device=_device()), name=f"layout.{tag}")
            raise AssertionError(f"chunked layout mismatch went unnoticed ({tag})")
        except MismatchError:
            pass
    out = bps.push_pull(torch.ones(per_chunk * 3, device="cuda"), average=False, name="after.layout")
    assert bool((out == n).all())


def check_cuda_optimizer_equivalence_and_state():
    r, n = bps.rank(), bps.size()
    device = _device()
    batch = 4
    # float64: float32 matmuls may run as TF32 on recent GPUs, whose rounding depends on
    # the batch shape and would swamp the 1e-5 tolerance.
    dt = torch.float64
    torch.manual_seed(123)
    data = torch.randn(n * batch, 6, device=device, dtype=dt)
    target = torch.randn(n * batch, 3, device=device, dtype=dt)
    mine = slice(r * batch, (r + 1) * batch)
    torch.manual_seed(7)
    ref = nn.Sequential(nn.Linear(6, 2048), nn.ReLU(), nn.Linear(2048, 3)).to(device, dt)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    for _ in range(5):
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(data), target).backward()
        ref_opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(model(data[mine]), target[mine]).backward()
        opt.step()
    diff = training.max_param_diff(ref, model)
    assert diff < 1e-5, diff
    optim_state._run("Adam", dict(lr=0.01), device)
    optim_state._run("SGD", dict(lr=0.1, momentum=0.9), device, wrap=True)


def check_cuda_ddp_averages():
    r, n = bps.rank(), bps.size()
    device = _device()
    torch.manual_seed(r)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(device)
    ddp = DistributedDataParallel(model)
    x = torch.full((2, 4), float(r + 1), device=device)
    ddp(x).sum().backward()
    grads = bps.broadcast_object([p.grad.cpu() for p in model.parameters()], root_rank=0)
    assert all(torch.equal(p.grad.cpu(), g) for p, g in zip(model.parameters(), grads))


def check_cuda_cross_barrier_equals_one_process():
    """CrossBarrier on CUDA (staged, fused and unfused) == one process on the whole batch."""
    device = _device()
    for fusion in (0, 1 << 20):
        ref, _, model, opt = training._cross_barrier_run(
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), fusion, device=device)
        opt.synchronize()
        diff = training.max_param_diff(ref, model)
        assert diff < 1e-9 and next(model.parameters()).is_cuda, (fusion, diff)


def check_cuda_unmodified_torch_ddp_over_the_bpstrain_backend():
    """torch's own DDP on CUDA over init_process_group("bpstrain") == one process, big batch."""
    import torch.distributed as dist

    import torch_checks_c10d as c10d

    device = _device()
    rank, size = c10d._init()
    t = torch.full((5,), float(rank + 1), device=device)
    dist.all_reduce(t)
    assert t.is_cuda and torch.all(t == size * (size + 1) / 2), t
    base = c10d._model()
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base).to(device),
                                                    bucket_cap_mb=0.001)
    ours = c10d._train(ddp, [(x.to(device), y.to(device)) for x, y in c10d._batches(rank)])
    every = [c10d._batches(r) for r in range(size)]
    big = [(torch.cat([every[r][s][0] for r in range(size)]),
            torch.cat([every[r][s][1] for r in range(size)])) for s in range(len(every[0]))]
    single = c10d._train(copy.deepcopy(base), big)
    for a, c in zip(ours, single):
        assert a.is_cuda and torch.allclose(a.cpu(), c, atol=1e-5), (a.cpu() - c).abs().max()
