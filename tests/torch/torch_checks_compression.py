"""Compression checks run by every rank of a launched job (see torch_check_worker.py).

Each rank knows every rank's inputs (seeded by rank and step), so it replays the whole
round in numpy — workers encode with :mod:`bpstrain._codec` (their residual added),
the servers decode, sum, add their residual and re-encode (``_codec.server_round``),
workers decode and divide — and compares with what the job answered, over two steps
so that both sides' error feedback is exercised.
"""

import io

import numpy as np
import torch

import bpstrain.torch as bps
from bpstrain import _codec
from bpstrain._compression import parse_compression, powersgd_initial_q
from bpstrain.torch import _compressors

STEPS = 2
SHAPE = (20, 50)  # 1000 elements


def _input(rank, step, shape=SHAPE, salt=0):
    rng = np.random.default_rng([salt, rank, step])
    return rng.standard_normal(shape).astype(np.float32)


def np_encode(spec, x):
    """The reference wire string of flat ``x`` under a byte codec (chunk by chunk)."""
    out, start = [], 0
    for n in _codec.chunk_sizes(x.size, spec.chunk):
        k = _codec.topk_count(n, spec.ratio) if spec.codec == "topk" else 0
        out.append(_codec.encode(spec.wire_codec, x[start:start + n], scaled=spec.scaled,
                                 levels=spec.levels, k=k, server_ef=spec.server_error_feedback))
        start += n
    return b"".join(out)


def simulate_bytes(spec, inputs, average=True):
    """Results per step of a byte codec: inputs[step][rank] are flat fp32 arrays."""
    n = len(inputs[0])
    worker_res = [np.zeros_like(inputs[0][0]) for _ in range(n)]
    server_res = {}
    results = []
    for per_rank in inputs:
        blobs = []
        for r, x in enumerate(per_rank):
            x = x + worker_res[r] if spec.ef else x
            blob = np_encode(spec, x)
            if spec.ef:
                worker_res[r] = x - _codec.decode_all(blob)
            blobs.append(blob)
        answer = _codec.decode_all(_codec.server_round(blobs, server_res))
        results.append(answer / np.float32(n) if average else answer)
    return results, worker_res


def _close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=what)


def check_byte_codecs_match_numpy_reference(device="cpu"):
    r, n = bps.rank(), bps.size()
    specs = ["onebit", "onebit:scaled=false", "topk:0.05", "dithering:8:stochastic=false",
             "onebit:chunk=300", "topk:0.1:chunk=256:server_error_feedback=false",
             "dithering:3:stochastic=false:chunk=400:error_feedback=false"]
    for salt, text in enumerate(specs):
        spec = parse_compression(text)
        for average in (True, False):
            comp = _compressors.from_spec(spec)
            name = f"cmp.bytes.{salt}.{average}"
            inputs = [[_input(k, s, salt=salt).ravel() for k in range(n)] for s in range(STEPS)]
            want, residuals = simulate_bytes(spec, inputs, average)
            for s in range(STEPS):
                got = bps.push_pull(torch.from_numpy(_input(r, s, salt=salt)).to(device),
                                    average=average, name=name, compression=comp)
                assert got.shape == SHAPE and got.dtype == torch.float32
                assert got.device.type == device
                _close(got.cpu().numpy().ravel(), want[s], f"{text} average={average} step {s}")
            if spec.ef:
                _close(comp._tensors[name]["residual"].cpu().numpy(), residuals[r],
                       f"{text} residual")


def check_randomk_matches_numpy(device="cpu"):
    r, n = bps.rank(), bps.size()
    comp = bps.Compression.randomk(0.1, seed=3)
    name, numel = "cmp.randomk", SHAPE[0] * SHAPE[1]
    k = _codec.topk_count(numel, 0.1)
    res = [np.zeros(numel, np.float32) for _ in range(n)]
    for s in range(STEPS):
        idx = _codec.randomk_indices(numel, k, 3, name, s)
        xs = [_input(q, s, salt=10).ravel() + res[q] for q in range(n)]
        want = np.zeros(numel, np.float32)
        want[idx] = sum(x[idx] for x in xs) / np.float32(n)
        for q in range(n):
            res[q] = xs[q].copy()
            res[q][idx] = 0
        got = bps.push_pull(torch.from_numpy(_input(r, s, salt=10)).to(device), name=name,
                            compression=comp)
        assert got.device.type == device
        _close(got.cpu().numpy().ravel(), want, f"random-k step {s}")
    _close(comp._tensors[name]["residual"].cpu().numpy(), res[r], "random-k residual")


def np_orthogonalize(p):
    p = p.copy()
    for i in range(p.shape[1]):
        p[:, i] /= max(np.linalg.norm(p[:, i]), np.finfo(np.float32).tiny)
        if i + 1 < p.shape[1]:
            p[:, i + 1:] -= np.outer(p[:, i], p[:, i] @ p[:, i + 1:])
    return p


def check_powersgd_matches_numpy(device="cpu"):
    r, n = bps.rank(), bps.size()
    shape, rank = (24, 5, 6), 2  # a conv-like weight: the matrix is 24 x 30
    comp = bps.Compression.powersgd(rank, seed=7)
    name = "cmp.powersgd"
    q = powersgd_initial_q(30, rank, 7, name)
    res = [np.zeros((24, 30), np.float32) for _ in range(n)]
    for s in range(STEPS):
        ms = [_input(k, s, shape, salt=20).reshape(24, 30) + res[k] for k in range(n)]
        p = np_orthogonalize(sum(m @ q for m in ms) / np.float32(n))
        q = sum(m.T @ p for m in ms) / np.float32(n)
        want = p @ q.T
        res = [m - want for m in ms]
        got = bps.push_pull(torch.from_numpy(_input(r, s, shape, salt=20)).to(device),
                            name=name, compression=comp)
        assert got.shape == shape and got.device.type == device
        np.testing.assert_allclose(got.cpu().numpy().reshape(24, 30), want, rtol=1e-4, atol=1e-4)
    bias = torch.full((7,), float(r), device=device)
    got = bps.push_pull(bias, name="cmp.powersgd.bias", compression=comp)  # 1-D: plain average
    assert torch.allclose(got.cpu(), torch.full((7,), (n - 1) / 2)), got


def check_cast_compressors_average():
    r, n = bps.rank(), bps.size()
    x = torch.full((3000,), float(r) + 0.5)
    want = torch.full((3000,), sum(k + 0.5 for k in range(n)) / n)
    for c in (bps.Compression.fp16, bps.Compression.bf16):
        assert torch.equal(bps.push_pull(x, name=f"cmp.cast.{c.__name__}", compression=c), want)
    got = bps.push_pull(x, name="cmp.cast.spec", compression=bps.Compression.from_spec("bf16"))
    assert got.dtype == torch.float32 and torch.equal(got, want)


def _train(compression, steps, state=None, start=0, cross_barrier=False):
    """(model, optimizer) after ``steps`` SGD steps from ``start`` (loading ``state`` first)."""
    r = bps.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.Tanh(), torch.nn.Linear(50, 30))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if cross_barrier:
        opt = bps.CrossBarrier(model, sgd, named_parameters=model.named_parameters(),
                               compression=compression)
    else:
        opt = bps.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                       compression=compression)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    for s in range(start, start + steps):
        x = torch.from_numpy(_input(r, s, (8, 40), salt=30))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    if cross_barrier:
        opt.synchronize()  # apply what is pending
    return model, opt


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


def check_optimizer_state_survives_checkpoint_resume():
    # The servers' residuals are theirs (a restarted job starts them at zero, and the
    # rebuilt optimizer's tensors have new engine names): off here, so that resuming
    # must give exactly the uninterrupted run.
    cases = [
        "onebit:server_error_feedback=false",
        "dithering:8:server_error_feedback=false",  # stochastic: the step counter matters
        bps.Compression.policy("topk:0.1:server_error_feedback=false",
                               rules=[("2.*", "randomk:0.2")]),
        bps.Compression.powersgd(2),
    ]
    for compression in cases:
        whole, _ = _train(compression, 4)
        model, opt = _train(compression, 2)
        state = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
        assert "bpstrain_compression" in state["opt"]
        assert state["opt"]["bpstrain_compression"]["compressors"], compression
        resumed, _ = _train(compression, 2, state, start=2)
        for (key, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
            assert torch.equal(a, b), (compression, key, (a - b).abs().max())
        # And without the compressor state the run differs: the test tests something.
        del state["opt"]["bpstrain_compression"]
        other, _ = _train(compression, 2, state, start=2)
        assert not all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(),
                                                         other.state_dict().values())), compression


def check_servers_residuals_survive_checkpoint_resume():
    # With the servers' residuals exported (collective) and imported at load.
    for compression in ("onebit", "topk:0.05", "dithering:4:stochastic=false"):
        whole, _ = _train(compression, 4)
        model, opt = _train(compression, 2)
        state = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict(server_state=True)})
        servers = state["opt"]["bpstrain_compression"]["servers"]
        assert set(servers) == {"0.weight", "2.weight"}, sorted(servers)
        assert all(np.count_nonzero(r) for r in servers.values()), compression
        resumed, _ = _train(compression, 2, state, start=2)
        for (key, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
            assert torch.equal(a, b), (compression, key, (a - b).abs().max())


def check_optimizer_compresses_large_parameters_only():
    model, opt = _train("topk:0.1", 1)
    assert set(opt._bps_stateful) == {id(model[0].weight), id(model[2].weight)}
    fused = {id(p) for b in opt._bps_buckets for p in b.params}
    assert not fused & set(opt._bps_stateful)


def check_auto_decides_alike_on_every_rank():
    x = torch.randn(4096)
    off = bps.Compression.auto("onebit", steps=2, bandwidth=1e15)  # wire time is free
    on = bps.Compression.auto("onebit", steps=2, bandwidth=1.0)    # 1 byte/s: always pays
    for s in range(4):
        bps.push_pull(x, name="cmp.auto.off", compression=off)
        bps.push_pull(x, name="cmp.auto.on", compression=on)
    assert off.decision("cmp.auto.off") is False and on.decision("cmp.auto.on") is True
    got = bps.push_pull(torch.full((4096,), float(bps.rank())), name="cmp.auto.off", compression=off)
    assert torch.equal(got, torch.full((4096,), (bps.size() - 1) / 2))  # off: exact average


def check_auto_times_both_ways_and_decides_alike_on_every_rank():
    from bpstrain import _compression

    saved, _compression.AUTO_CLEAR_MARGIN = _compression.AUTO_CLEAR_MARGIN, float("inf")
    try:  # no figure is clear now: every tensor is timed both ways
        auto = bps.Compression.auto("onebit", steps=2, bandwidth=1e9)
        phases = []
        for s in range(12):
            x = torch.full((50_000,), float(bps.rank() + s))
            got = bps.push_pull(x, name="cmp.auto.timed", compression=auto)
            phases.append(auto.policy._tracks["cmp.auto.timed"].last_arm)
            if phases[-1] == "compare":  # sent uncompressed: the exact average
                assert torch.equal(got, torch.full((50_000,), (bps.size() - 1) / 2 + s)), s
    finally:
        _compression.AUTO_CLEAR_MARGIN = saved
    # 2 measured steps and 1 more while the ranks' mean is in flight, 3 timed each way
    assert phases[:9] == [""] * 3 + ["trial"] * 3 + ["compare"] * 3, phases
    decided = auto.decision("cmp.auto.timed")
    assert decided is not None, phases
    both = bps.push_pull(torch.tensor([float(decided)]), average=False, name="cmp.auto.decided")
    assert both.item() in (0.0, bps.size()), both  # every rank alike


def check_cross_barrier_compresses_as_distributed_optimizer_does():
    for compression in ("topk:0.1", bps.Compression.powersgd(2)):  # PowerSGD: two rounds via poll()
        plain, _ = _train(compression, 3)
        crossed, _ = _train(compression, 3, cross_barrier=True)
        for a, b in zip(plain.state_dict().values(), crossed.state_dict().values()):
            assert torch.equal(a, b), compression


def check_optimizer_with_auto_switches_off_on_a_free_link():
    auto = bps.Compression.auto("onebit", steps=1, bandwidth=1e15)
    model, opt = _train(auto, 3)
    comp = opt._bps_stateful[id(model[0].weight)]
    assert comp.decision("0.weight") is False and comp.decision("2.weight") is False
    state = opt.state_dict()["bpstrain_compression"]["compressors"]
    assert any("auto" in text for text in state), list(state)


def check_ddp_compresses_as_distributed_optimizer_does():
    from bpstrain.torch.parallel import DistributedDataParallel

    r = bps.rank()
    want, _ = _train("randomk:0.2", 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.Tanh(), torch.nn.Linear(50, 30))
    ddp = DistributedDataParallel(model, compression=bps.Compression.randomk(0.2))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(2):
        sgd.zero_grad()
        ddp(torch.from_numpy(_input(r, s, (8, 40), salt=30))).square().mean().backward()
        sgd.step()
    for a, b in zip(want.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    assert set(ddp.compression_state_dict()["compressors"]) == {"randomk:ratio=0.2"}


def check_every_compressor_trains_a_least_squares_model():
    r = bps.rank()
    target = torch.from_numpy(_input(0, 0, (40, 30), salt=40))
    losses = {}
    for text in ("none", "fp16", "onebit", "topk:0.05", "randomk:0.1", "dithering:8", "powersgd:2",
                 "auto:onebit"):
        torch.manual_seed(0)
        model = torch.nn.Linear(40, 30, bias=False)
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(), compression=text)
        first = None
        for s in range(100):
            x = torch.from_numpy(_input(r, s, (16, 40), salt=41))
            opt.zero_grad()
            loss = (model(x) - x @ target).square().mean()
            loss.backward()
            opt.step()
            first = first if first is not None else loss.item()
        losses[text] = (first, loss.item())
    for text, (first, last) in losses.items():
        assert last < first / 50, losses  # error feedback keeps every codec converging
