"""bpstrain.torch in one process without a cluster (rank 0 of 1), plus pure helpers.

Everything here runs in the pytest process: no launch, no servers.
"""

import os

import pytest
import torch

import bpstrain.torch as bps
from bpstrain.torch import _cuda, _fusion, _tensors
from bpstrain.torch.parallel import DistributedDataParallel


@pytest.fixture(autouse=True)
def standalone(monkeypatch):
    for name in [n for n in os.environ if n.startswith("DMLC_")]:
        monkeypatch.delenv(name)
    bps.shutdown()
    bps.init()
    yield
    bps.shutdown()


@pytest.mark.timeout(30)
def test_standalone_collectives_return_the_input_for_every_dtype():
    assert (bps.rank(), bps.size(), bps.local_rank(), bps.local_size()) == (0, 1, 0, 1)
    assert not bps.distributed()
    for dt in [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
               torch.uint8, torch.int32, torch.int64]:
        for x in (torch.arange(6).reshape(2, 3).to(dt), torch.tensor(5).to(dt)):
            out = bps.push_pull(x, average=False, name=f"s.{dt}.{x.dim()}")
            assert out.dtype == dt and out.shape == x.shape and torch.equal(out, x)
            assert out.data_ptr() != x.data_ptr()
            assert torch.equal(bps.broadcast(x, 0, name=f"b.{dt}.{x.dim()}"), x)
    y = torch.arange(6.0).reshape(2, 3).t()
    assert bps.push_pull_inplace(y) is y and torch.equal(y, torch.arange(6.0).reshape(2, 3).t())
    handle = bps.push_pull_async(torch.ones(3))
    assert bps.poll(handle) and torch.equal(bps.synchronize(handle), torch.ones(3))


@pytest.mark.timeout(30)
def test_errors_are_typed_and_say_what_was_received():
    with pytest.raises(ValueError, match="Received: dtype=torch.bool"):
        bps.push_pull(torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="root_rank must be in"):
        bps.broadcast(torch.ones(2), root_rank=1)
    with pytest.raises(ValueError, match="unknown handle"):
        bps.synchronize(12345)
    with pytest.raises(ValueError, match="non-empty tensor name"):
        bps.declare("")
    bps.declare("fine")
    bps.shutdown()
    with pytest.raises(ValueError, match="not been initialized"):
        bps.push_pull(torch.ones(1))


@pytest.mark.timeout(30)
def test_autograd_compression_and_broadcast_helpers():
    x = torch.ones(3, requires_grad=True)
    bps.push_pull(x, average=False, compression=bps.Compression.fp16).sum().backward()
    assert torch.equal(x.grad, torch.ones(3))
    obj = {"a": [1, 2], "t": torch.arange(3)}
    got = bps.broadcast_object(obj)
    assert got["a"] == [1, 2] and torch.equal(got["t"], obj["t"])
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    bps.broadcast_optimizer_state(opt, root_rank=0)  # empty state: options only
    assert not opt.state


@pytest.mark.timeout(30)
def test_optimizer_and_ddp_work_alone():
    model = torch.nn.Linear(3, 1)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    before = model.weight.detach().clone()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert torch.allclose(model.weight, before - 1)
    ddp = DistributedDataParallel(torch.nn.Linear(3, 1))
    ddp(torch.ones(2, 3)).sum().backward()
    assert torch.equal(ddp.module.weight.grad, torch.full((1, 3), 2.0))
    with ddp.no_sync():
        ddp(torch.ones(2, 3)).sum().backward()


def test_chunk_plan_names_shapes_and_layouts():
    small = torch.zeros(2, 3)
    assert _cuda.chunk_plan("x", small, 1 << 20) == [
        _cuda.Chunk("x", 0, 6, (2, 3), "chunks:1048576:0/1:2x3")]
    big = torch.zeros(10, 3)
    chunks = _cuda.chunk_plan("y", big, 48)  # 12 float32 per chunk
    assert [c.name for c in chunks] == ["y", "y.part1", "y.part2"]
    assert [(c.start, c.stop, c.shape) for c in chunks] == [(0, 12, (12,)), (12, 24, (12,)),
                                                           (24, 30, (6,))]
    assert [c.layout for c in chunks] == [f"chunks:48:{i}/3:10x3" for i in range(3)]
    assert _cuda.chunk_plan("z", torch.tensor(1.0), 64)[0].shape == (1,)


def test_chunk_layouts_differ_whenever_ranks_cut_differently():
    """The layout string is what the scheduler compares: any other cut must differ."""
    def first(shape, chunk_bytes):
        c = _cuda.chunk_plan("t", torch.zeros(shape), chunk_bytes)[0]
        return c.shape, c.layout

    reference = first((4 * 12, 1), 48)
    for shape, chunk_bytes in [((4 * 12, 1), 96),  # another chunk size
                               ((2 * 12, 2), 48),  # same chunks, another tensor shape
                               ((5 * 12, 1), 48)]:  # one chunk more
        assert first(shape, chunk_bytes) != reference, (shape, chunk_bytes)
    assert first((4 * 12, 1), 50) == reference  # 50 bytes cut like 48: the same layout
    assert _tensors.pieces(0, 4) == [(0, 0)] and _tensors.pieces(9, 4) == [(0, 4), (4, 8), (8, 9)]
    assert _tensors.chunk_bytes(0) == _tensors.DEFAULT_CHUNK_BYTES  # auto partitions


def test_plan_buckets_groups_small_consecutive_parameters():
    params = [torch.zeros(4), torch.zeros(4), torch.zeros(1000), torch.zeros(4), torch.zeros(4),
              torch.zeros(4, dtype=torch.float64)]
    buckets = _fusion.plan_buckets(params, "p.", threshold_bytes=1024, bucket_bytes=1 << 20)
    members = [[next(i for i, q in enumerate(params) if q is p) for p in b.params] for b in buckets]
    assert members == [[3, 4], [0, 1]]  # backward order; big tensor and dtype change split
    assert [b.priority for b in buckets] == [-3, 0]
    assert _fusion.plan_buckets(params, "p.", threshold_bytes=0, bucket_bytes=1 << 20) == []


@pytest.mark.timeout(120)
def test_examples_run_standalone(capsys):
    from bpstrain.torch.examples import benchmark_synthetic, train_mnist

    accuracy = train_mnist.main(["--epochs", "2", "--log-interval", "1000", "--no-cuda"])
    assert accuracy > 0.3
    bps.init()
    benchmark_synthetic.main(["--model", "digits_cnn", "--num-classes", "10", "--image-size", "8", "--image-channels", "1",
                              "--batch-size", "4", "--num-warmup-batches", "1",
                              "--num-batches-per-iter", "2", "--num-iters", "2", "--no-cuda"])
    assert "Total img/sec on 1 CPU(s)" in capsys.readouterr().out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("consistency", ["sync", "ssp:1"])
def test_named_parameters_are_checked_the_same_way_in_every_mode(monkeypatch, consistency):
    """The sync optimizer and the servers' one (ssp/async) share one validator."""
    monkeypatch.setenv("BPSTRAIN_CONSISTENCY", consistency)
    bps.shutdown()
    bps.init()
    m = torch.nn.Linear(2, 2)
    opt = bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
    assert hasattr(opt, "_bps_spec") == (consistency != "sync")  # the servers' optimizer's methods
    for named, why in (([("a", m.weight), ("a", m.bias)], "must be unique"),
                       ([("w", m.weight)], "does not name every parameter"),
                       ([m.weight, m.bias], r"sequence of \(name, parameter\)")):
        with pytest.raises(ValueError, match=why):
            bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=named)


@pytest.mark.timeout(30)
def test_the_elastic_state_alone_keeps_its_values_and_admits_nobody():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = bps.ElasticSampler(range(10), shuffle=False)
    state = bps.elastic.TorchState(model, opt, sampler=sampler, epoch=2, step=7)
    before = [p.detach().clone() for p in model.parameters()]
    state.sync()
    assert (state.epoch, state.step, state.syncs) == (2, 7, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert state.commit() == [] and state.syncs == 1  # nobody can join a job of one
    assert list(sampler) == list(range(10))
    from bpstrain import engine
    assert engine.admit() == [] and engine.membership()["joined"] == []
