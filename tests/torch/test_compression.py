"""Gradient compression: specs and rules, torch codecs against the numpy reference, the
stateful compressors alone (rank 0 of 1) and in 2- and 3-worker jobs
(torch_checks_compression.py, run by the launcher as test_torch_jobs.py runs its checks).
"""

import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import bpstrain.torch as bps
from bpstrain import _codec, engine
from bpstrain._compression import (AutoPolicy, CompressionPolicy, CompressionSpec, parse_compression,
                                   parse_policy)
from bpstrain.torch import _codecs, _compressors

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_torch_jobs import _assert_check, run_job  # noqa: E402
from torch_check_worker import collect  # noqa: E402
from torch_checks_compression import np_encode, simulate_bytes  # noqa: E402

from tests.dgc_reference import dgc_steps, top  # noqa: E402

ENGINE_HAS_CODECS = "compressed" in engine.DTYPES
needs_codecs = pytest.mark.skipif(not ENGINE_HAS_CODECS,
                                  reason="the engine has no 'compressed' dtype yet (servers' codec)")


@pytest.fixture
def standalone(monkeypatch):
    for name in [n for n in os.environ if n.startswith("DMLC_")]:
        monkeypatch.delenv(name)
    bps.shutdown()
    bps.init()
    yield
    bps.shutdown()


# -- specs and rules ------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["none", "fp16", "bf16", "onebit", "onebit:scaled=false", "topk:0.01",
                                  "randomk:0.01:seed=4", "dithering:16", "powersgd:2", "auto",
                                  "auto:topk:0.01", "auto:steps=3:bandwidth=1e9:onebit",
                                  "topk:0.01,error_feedback=false", "dithering:4:stochastic=false",
                                  "topk:0.01:momentum=0.9", "topk:0.05:momentum=0.5:chunk=300"])
def test_spec_strings_round_trip(text):
    spec = parse_compression(text)
    assert parse_compression(str(spec)) == spec


def test_spec_defaults_and_error_feedback():
    assert parse_compression("topk:0.01") == parse_compression({"codec": "topk", "ratio": 0.01,
                                                                "error_feedback": True})
    assert parse_compression("onebit").ef and not parse_compression("onebit:error_feedback=0").ef
    assert not parse_compression("fp16").ef and not parse_compression("fp16").lossy
    assert parse_compression("auto").inner == parse_compression("fp16")
    assert parse_compression("auto:onebit").lossy
    assert parse_compression(None) == CompressionSpec()


@pytest.mark.parametrize("text,words", [("zip", "unknown compression"), ("topk", "ratio in (0, 1]"),
                                        ("topk:2", "ratio in (0, 1]"), ("dithering", "levels"),
                                        ("dithering:200", "1..127"), ("powersgd:0", "rank >= 1"),
                                        ("onebit:ratio=0.1", "onebit takes"),
                                        ("onebit:scaled=maybe", "true or false"), ("auto:none", "auto wraps"),
                                        ("fp16:error_feedback=true", "fp16 takes no options"),
                                        ("topk:0.01:momentum=1", "momentum must be in [0, 1)"),
                                        ("onebit:momentum=0.9", "onebit takes"),
                                        ("topk:0.1:momentum=0.9:error_feedback=false", "needs error_feedback"),
                                        ("randomk:0.1:momentum=0.9", "randomk takes"),
                                        ("auto:topk:0.01:momentum=0.9", "auto sends some tensors plain")])
def test_spec_errors_say_what_was_received(text, words):
    with pytest.raises(ValueError, match="Received") as err:
        parse_compression(text)
    assert words in str(err.value)


def test_policy_rules_first_match_min_sizes_and_buckets():
    policy = CompressionPolicy("topk:0.01", rules=[{"pattern": "*.bias", "compression": "none"},
                                                   ("embed*", "fp16", 10_000), ("embed*", "onebit")],
                               min_size=1024)
    assert policy.spec_for("fc.weight", 1023).codec == "none"  # below the global minimum
    assert policy.spec_for("fc.weight", 5000).codec == "topk"
    assert policy.spec_for("fc.bias", 5000).codec == "none"
    assert policy.spec_for("embed.weight", 20_000).codec == "fp16"
    assert policy.spec_for("embed.weight", 5000).codec == "onebit"  # the first rule's min_size
    assert policy.bucket_spec().codec == "none"
    assert CompressionPolicy("bf16").bucket_spec().codec == "bf16"
    cfg = parse_policy({"compression": "onebit", "rules": [{"pattern": "x", "compression": "fp16"}],
                        "min_size": 0})
    assert cfg.min_size == 0 and cfg.spec_for("x", 1).codec == "fp16"
    with pytest.raises(ValueError, match="Received"):
        CompressionPolicy("none", rules=[{"pattern": "x", "compresion": "fp16"}])


# -- torch codecs against the numpy reference -----------------------------------------------

def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("text", ["onebit", "onebit:scaled=false", "topk:0.05", "topk:1.0",
                                  "dithering:16:stochastic=false", "dithering:1:stochastic=false",
                                  "onebit:chunk=100", "topk:0.1:chunk=64",
                                  "dithering:5:chunk=50:server_error_feedback=false"])
def test_torch_encoding_is_the_reference_byte_for_byte(text, device):
    spec = parse_compression(text)
    rng = np.random.default_rng(1)
    for n in (1, 7, 8, 13, 250, 1000):
        x = rng.standard_normal(n).astype(np.float32)
        x[::5] = x[0]   # ties in magnitude: top-k takes the lower index
        x[1::7] = -x[0]
        x[2::11] = 0.0
        data, sent = _codecs.encode(spec, torch.from_numpy(x).to(device))
        ref = np_encode(spec, x)
        assert data.device.type == device and data.cpu().numpy().tobytes() == ref, (text, n)
        want = _codec.decode_all(ref)
        assert np.array_equal(sent.cpu().numpy(), want), (text, n)
        assert np.array_equal(_codecs.decode(spec, data, n).cpu().numpy(), want), (text, n)


@pytest.mark.parametrize("text", ["onebit", "onebit:scaled=false", "topk:0.05", "topk:1.0",
                                  "dithering:16:stochastic=false", "onebit:chunk=100",
                                  "topk:0.1:chunk=64", "dithering:5:chunk=50:server_error_feedback=false"])
def test_cpu_tensors_use_the_servers_codec_with_the_same_bytes(text):
    # CPU gradients go through the C++ codec (encode_host): byte for byte the torch
    # encoding and the reference, and the residual is x minus what was sent.
    spec = parse_compression(text)
    rng = np.random.default_rng(3)
    for n in (1, 13, 250, 1000):
        x = rng.standard_normal(n).astype(np.float32)
        x[::5] = x[0]
        data, residual = _codecs.encode_host(spec, torch.from_numpy(x))
        assert data.numpy().tobytes() == np_encode(spec, x), (text, n)
        sent = _codec.decode_all(data.numpy().tobytes())
        assert np.array_equal(residual.numpy(), x - sent)
        assert np.array_equal(_codecs.check_answer(data, n).numpy(), sent)


def test_stochastic_dithering_on_the_host_is_unbiased_and_reproducible():
    spec = parse_compression("dithering:2")
    x = torch.full((200_000,), 0.3)
    x[0] = 1.0  # scale 1: 0.3 lies between levels 0 and 0.5
    a, _ = _codecs.encode_host(spec, x, seed=7)
    b, _ = _codecs.encode_host(spec, x, seed=7)
    assert torch.equal(a, b)
    mean = _codec.decode_all(a.numpy().tobytes())[1:].mean()
    assert abs(mean - 0.3) < 0.005  # rounding to nearest would give 0.5


@pytest.mark.parametrize("corrupt,words", [
    (lambda b: b[:-3], "bytes announced"),
    (lambda b: b[:4] + b"\xff\xff\xff\x7f" + b[8:], "the blobs hold 2147483647 elements"),  # n claims 2^31-1
    (lambda b: bytes([9]) + b[1:], "unknown codec 9"),
])
def test_a_malformed_answer_is_refused_before_it_is_decoded(corrupt, words):
    from bpstrain.errors import PeerError

    good = np_encode(parse_compression("topk:0.1"), np.arange(100, dtype=np.float32))
    with pytest.raises(PeerError, match=words):
        _codecs.check_answer(torch.frombuffer(bytearray(corrupt(good)), dtype=torch.uint8), 100)
    with pytest.raises(PeerError, match="the blobs hold 100 elements, the output 99"):
        _codecs.check_answer(torch.frombuffer(bytearray(good), dtype=torch.uint8), 99)


@pytest.mark.parametrize("device", _devices())
def test_stochastic_dithering_and_server_answers_decode_alike(device):
    rng = np.random.default_rng(2)
    x = rng.standard_normal(500).astype(np.float32)
    u = rng.random(500)
    data, _ = _codecs.encode_dithering(torch.from_numpy(x).to(device), 7,
                                       _codec.FLAG_SERVER_EF, torch.from_numpy(u).to(device))
    assert data.cpu().numpy().tobytes() == _codec.encode(_codec.DITHERING, x, levels=7, u=u)
    # A server's answer (sum of two workers, re-encoded) decodes as the reference does.
    spec = parse_compression("topk:0.1:chunk=128")
    blobs = [np_encode(spec, rng.standard_normal(500).astype(np.float32)) for _ in range(2)]
    answer = _codec.server_round(blobs)
    got = _codecs.decode(spec, torch.frombuffer(bytearray(answer), dtype=torch.uint8).to(device), 500)
    assert np.array_equal(got.cpu().numpy(), _codec.decode_all(answer))


# -- the stateful compressors alone ---------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", _devices())
def test_top_k_with_momentum_correction_alone_follows_dgc(standalone, device):
    m, n, k = 0.9, 1000, 10
    grads = [np.random.default_rng(s).standard_normal(n).astype(np.float32) for s in range(4)]
    want, u, v = dgc_steps(grads, m, top(k))
    comp = bps.Compression.topk(k / n, momentum=m)
    for s, g in enumerate(grads):
        got = bps.push_pull(torch.from_numpy(g).to(device), name="w", compression=comp)
        assert got.device.type == device
        np.testing.assert_allclose(got.cpu().numpy(), want[s], rtol=1e-5, atol=1e-6)
    state = comp._tensors["w"]
    np.testing.assert_allclose(state["velocity"].cpu().numpy(), u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["residual"].cpu().numpy(), v, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_an_overflowed_step_leaves_momentum_corrections_state_as_it_was(standalone):
    comp = bps.Compression.topk(0.1, momentum=0.9)
    g = torch.from_numpy(np.random.default_rng(0).standard_normal(200).astype(np.float32))
    bps.push_pull(g, name="w", compression=comp)
    before = {k: v.clone() for k, v in comp._tensors["w"].items() if k in ("velocity", "applied")}
    overflow = g.clone()
    overflow[3] = float("inf")
    assert not torch.isfinite(bps.push_pull(overflow, name="w", compression=comp)).all()
    for key, value in before.items():
        assert torch.equal(comp._tensors["w"][key], value), key
    assert torch.isfinite(bps.push_pull(g, name="w", compression=comp)).all()


@pytest.mark.timeout(60)
def test_momentum_correction_needs_the_optimizers_momentum_to_match(standalone):
    def make(optimizer, compression):
        model = torch.nn.Linear(40, 30)
        return bps.DistributedOptimizer(optimizer(model.parameters()), model.named_parameters(),
                                        compression=compression)

    mc = bps.Compression.topk(0.01, momentum=0.9)
    make(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), mc)
    for wrong, words in [(lambda p: torch.optim.SGD(p, lr=0.1), "Received: momentum=0"),
                         (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), "nesterov=True"),
                         (lambda p: torch.optim.Adam(p), "momentum=None")]:
        with pytest.raises(ValueError, match="momentum correction") as err:
            make(wrong, mc)
        assert words in str(err.value)
    make(lambda p: torch.optim.Adam(p), bps.Compression.topk(0.01))  # no correction: any optimizer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", ["onebit", "topk:0.05", "dithering:8:stochastic=false",
                                  "onebit:chunk=300:error_feedback=false"])
def test_byte_codecs_alone_follow_the_reference_with_error_feedback(standalone, text):
    spec = parse_compression(text)
    comp = _compressors.from_spec(spec)
    xs = [[np.random.default_rng(s).standard_normal(1000).astype(np.float32)] for s in range(3)]
    # Alone, the engine hands the worker's own blob back: the reference with one worker
    # decodes to the same values (re-encoding a decoded blob changes nothing).
    want, _ = simulate_bytes(spec, xs)
    for s in range(3):
        got = bps.push_pull(torch.from_numpy(xs[s][0]).view(10, 100), name="w", compression=comp)
        assert got.shape == (10, 100)
        np.testing.assert_allclose(got.numpy().ravel(), want[s], rtol=1e-6, atol=1e-7)
    assert comp._tensors["w"]["step"] == 3


@pytest.mark.timeout(60)
def test_compressors_keep_dtype_shape_and_device_and_refuse_unnamed(standalone):
    for comp in (bps.Compression.onebit(), bps.Compression.topk(0.1), bps.Compression.dithering(4),
                 bps.Compression.randomk(0.1), bps.Compression.powersgd(1),
                 bps.Compression.auto("onebit"), bps.Compression.policy("onebit", min_size=0)):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            x = torch.randn(12, 30).to(dtype)
            out = bps.push_pull(x, name=f"k.{dtype}", compression=comp)
            assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
        with pytest.raises(ValueError, match="needs its name"):
            bps.push_pull(x, compression=comp)
    with pytest.raises(ValueError, match="floating-point"):
        bps.push_pull(torch.ones(5, dtype=torch.int32), name="i", compression=bps.Compression.onebit())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(120)
def test_cuda_tensors_are_compressed_on_their_gpu_as_on_the_cpu(standalone):
    specs = ["onebit", "topk:0.05", "dithering:8:stochastic=false", "randomk:0.1", "powersgd:2",
             "onebit:chunk=500", "auto:steps=1:bandwidth=1:topk:0.1"]
    for text in specs:
        on_cpu, on_gpu = _compressors.from_spec(text), _compressors.from_spec(text)
        for s in range(3):
            x = torch.randn(40, 60, generator=torch.Generator().manual_seed(s))
            want = bps.push_pull(x, name="g", compression=on_cpu)
            got = bps.push_pull(x.cuda(), name="g", compression=on_gpu)
            assert got.is_cuda and got.shape == x.shape, text
            torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5, msg=text)
        residual = on_gpu._tensors.get("g", {}).get("residual")
        assert residual is None or residual.is_cuda, text  # state stays on the GPU


def test_classic_interface_is_unchanged(standalone):
    small, ctx = bps.Compression.fp16.compress(torch.ones(3))
    assert small.dtype == torch.float16 and bps.Compression.fp16.decompress(small, ctx).dtype == torch.float32
    small, ctx = bps.Compression.bf16.compress(torch.ones(3, dtype=torch.float64))
    assert small.dtype == torch.bfloat16 and bps.Compression.bf16.decompress(small, ctx).dtype == torch.float64
    x = torch.ones(4, requires_grad=True)
    bps.push_pull(x, name="d", compression=bps.Compression.fp16).sum().backward()  # differentiable
    assert torch.equal(x.grad, torch.ones(4))
    with pytest.raises(ValueError, match="from_spec"):
        bps.push_pull(torch.ones(3), name="s", compression="topk:0.1")
    assert bps.push_pull(torch.ones(3), name="s", compression="bf16").dtype == torch.float32
    with pytest.raises(ValueError, match="from_spec"):
        bps.push_pull(torch.ones(3), name="s", compression="auto")
    with pytest.raises(ValueError, match="call it"):
        _compressors.for_optimizer(bps.Compression.onebit)
    assert _compressors.for_optimizer(bps.Compression.fp16) is None


@pytest.mark.timeout(60)
def test_auto_turns_off_where_compression_costs_more_than_it_saves(standalone, caplog):
    x = torch.randn(64, 64)
    fast = bps.Compression.auto("onebit", steps=2, bandwidth=1e15)  # the wire costs nothing
    slow = bps.Compression.auto("onebit", steps=2, bandwidth=1.0)
    with caplog.at_level(logging.INFO, logger="bpstrain.compression"):
        for _ in range(5):
            fast_out = bps.push_pull(x, name="a", compression=fast)
            slow_out = bps.push_pull(x, name="a", compression=slow)
    assert fast.decision("a") is False and slow.decision("a") is True
    assert torch.equal(fast_out, x) and not torch.equal(slow_out, x)
    logs = [r.getMessage() for r in caplog.records if r.name == "bpstrain.compression"]
    assert len(logs) == 2 and "auto compression off for a" in logs[0], logs  # once per decision
    restored = bps.Compression.auto("onebit", steps=2, bandwidth=1e15)
    restored.load_state_dict(fast.state_dict())
    assert restored.decision("a") is False  # sticky across a checkpoint


@pytest.mark.timeout(60)
def test_auto_switched_off_sends_an_optimizers_gradient_in_place(standalone):
    from bpstrain.torch import _compressors

    off = bps.Compression.auto("onebit", steps=1, bandwidth=1e15)
    x = torch.randn(64, 64)
    for _ in range(3):  # measure, then decided off
        bps.push_pull(x, name="g", compression=off)
    assert off.decision("g") is False
    grad, before = x.clone(), x.clone()
    out = bps.synchronize(off.push_pull_async(grad, "g", inplace=True))
    # The optimizers' path: no new output buffer, nothing to copy back.
    assert out.data_ptr() == grad.data_ptr() and torch.equal(grad, before)
    _compressors.copy_result(grad, out)
    kept = x.clone()
    out = bps.synchronize(off.push_pull_async(kept, "g"))  # the functional API's default
    assert out.data_ptr() != kept.data_ptr() and torch.equal(out, x)


def test_auto_policy_measures_an_uncompressed_push_pull_without_a_bandwidth():
    policy = AutoPolicy(steps=2, reduce=lambda values, name: values)
    assert policy.phase("t", "t") == "raw"
    policy.record_raw("t", 0.010, 4000)  # 4000 bytes in 10 ms
    for _ in range(2):
        assert policy.phase("t", "t") == "measure"
        policy.record_codec("t", 0.001, 4000, 200)  # saves 95 % of 10 ms for 1 ms
    assert policy.phase("t", "t") == "on" and policy.decision("t") is True
    cheap = AutoPolicy(steps=1, reduce=lambda values, name: values)
    cheap.phase("t", "t")
    cheap.record_raw("t", 0.001, 4000)
    cheap.phase("t", "t")
    cheap.record_codec("t", 0.005, 4000, 200)
    assert cheap.phase("t", "t") == "off"


def _close_call(policy, steps):
    """Drives one tensor through ``policy`` with a fake clock: ``steps`` maps a phase to the
    seconds a step sent that way takes. Returns the phases, in order, the deciding call's last."""
    now, phases = [0.0], []
    policy.clock = lambda: now[0]
    while policy.decision("t") is None:
        assert len(phases) < 40, phases
        phase = policy.phase("t", "t")
        phases.append(phase)
        if phase == "measure":
            policy.record_codec("t", 0.004, 4000, 200)  # 4 ms of codec ...
        now[0] += steps.get(phase, 0.0)
    return phases


@pytest.mark.parametrize("compressed_step,want", [(0.090, True), (0.110, False), (0.100, False)])
def test_auto_times_steps_both_ways_where_its_cost_model_is_unsure(compressed_step, want):
    # ... for 3800 bytes saved twice at 1 MB/s = 7.6 ms: within the margin, so the policy
    # sends 3 steps compressed and 3 uncompressed and keeps the faster (a tie: uncompressed).
    seen = []
    policy = AutoPolicy(steps=2, bandwidth=1e6,
                        reduce=lambda values, name: seen.append(list(values)) or values)
    phases = _close_call(policy, {"measure": 0.2, "on": compressed_step, "compare": 0.100})
    final = "on" if want else "off"
    assert phases == ["measure"] * 2 + ["on"] * 3 + ["compare"] * 3 + [final], phases
    assert policy.decision("t") is want
    assert seen[0] == pytest.approx([0.004, 0.0076]) and seen[1] == pytest.approx([compressed_step, 0.1])
    resumed = AutoPolicy(steps=2, bandwidth=1e6)
    resumed.load_state_dict(policy.state_dict())
    assert resumed.decision("t") is want and resumed.phase("t", "t") == final


def test_auto_trusts_its_cost_model_where_the_difference_is_clear():
    for bandwidth, want in ((1e4, True), (1e8, False)):  # 760 ms or 0.08 ms saved for 4 ms
        policy = AutoPolicy(steps=2, bandwidth=bandwidth, reduce=lambda values, name: values)
        assert _close_call(policy, {"measure": 0.1}) == ["measure"] * 2 + ["on" if want else "off"]
        assert policy.decision("t") is want


# -- jobs of 2 and 3 workers ----------------------------------------------------------------

GROUPS = ["torch_checks_compression"]
CHECKS = [name for name, _ in collect(GROUPS)]
# Checks that push engine dtype "compressed" (onebit/top-k/dithering on the servers).
CODEC_CHECKS = {"check_byte_codecs_match_numpy_reference", "check_optimizer_state_survives_checkpoint_resume",
                "check_servers_residuals_survive_checkpoint_resume",
                "check_cross_barrier_compresses_as_distributed_optimizer_does",
                "check_optimizer_with_auto_switches_off_on_a_free_link",
                "check_every_compressor_trains_a_least_squares_model",
                "check_optimizer_compresses_large_parameters_only", "check_auto_decides_alike_on_every_rank",
                "check_auto_times_both_ways_and_decides_alike_on_every_rank"}


def _marks(name):
    return [needs_codecs] if name in CODEC_CHECKS else []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in CHECKS])
def test_compression_on_2_workers(name):
    _assert_check(run_job(2, 1, GROUPS), name, 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in CHECKS])
def test_compression_on_3_workers_2_servers(name):
    _assert_check(run_job(3, 2, GROUPS), name, 3)
