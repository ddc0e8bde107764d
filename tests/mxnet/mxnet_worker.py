"""One worker of the multi-process bpstrain.mxnet test (run by test_mxnet.py).

Runs under the MXNet interpreter (.venv-mxnet: MXNet 1.9 needs numpy < 2). Every rank
runs the same sequence of collective calls and prints one ``CHECK {json}`` line per
check (name, rank, ok, error); the test reports them one by one.
"""

import os
import pickle
import sys

import numpy as np

import bpstrain.mxnet as bps  # before mxnet: it applies the numpy shim

import mxnet as mx  # noqa: E402,I100
from mxnet import autograd, gluon  # noqa: E402

from bpstrain.errors import MismatchError  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "keras"))
from launched_job import report_checks  # noqa: E402

DTYPES = ["float16", "float32", "float64", "uint8", "int8", "int32", "int64"]


def expect(actual, expected, what):
    """Exact comparison of an NDArray (or array) with ``expected``, naming the rank."""
    values = actual.asnumpy() if isinstance(actual, mx.nd.NDArray) else actual
    np.testing.assert_array_equal(np.asarray(values, np.float64), np.asarray(expected, np.float64),
                                  err_msg=f"rank {bps.rank()}: {what}")


def check_push_pull_and_broadcast_in_place(r, n):
    base = np.arange(6.0).reshape(2, 3)  # rank r sends base + r
    total = n * base + sum(range(n))
    root = n - 1
    for dtype in DTYPES:
        x = mx.nd.array(base + r, dtype=dtype)
        assert bps.push_pull(x, name=f"sum.{dtype}", is_average=False) is x
        expect(x, total, f"sum {dtype}")
        y = mx.nd.array(base + r, dtype=dtype)
        bps.push_pull(y, name=f"avg.{dtype}")
        want = total / n if dtype.startswith("float") else np.floor_divide(total, n)
        expect(y, want, f"average {dtype}")
        z = mx.nd.array(base + r, dtype=dtype)
        assert bps.broadcast(z, root_rank=root, name=f"bcast.{dtype}") is z
        expect(z, base + root, f"broadcast {dtype}")
    unnamed = bps.push_pull(mx.nd.ones((3,)) * (r + 1), is_average=False)  # auto-named
    expect(unnamed, [n * (n + 1) / 2] * 3, "unnamed push_pull")


def check_broadcast_parameters_dicts_and_gluon(r, n):
    arg = {"w": mx.nd.ones((2, 2)) * r, "b": mx.nd.arange(3) + 10 * r}
    bps.broadcast_parameters(arg, root_rank=0)
    expect(arg["w"], np.zeros((2, 2)), "dict w")
    expect(arg["b"], np.arange(3), "dict b")
    mx.random.seed(r)
    net = gluon.nn.Dense(3, in_units=4)
    net.initialize(mx.init.Normal(1.0))
    bps.broadcast_parameters(net.collect_params(), root_rank=n - 1)
    mine = np.concatenate([p.data().asnumpy().ravel() for p in net.collect_params().values()])
    every = bps.push_pull(mx.nd.array(mine, dtype="float64"), name="bp.check", is_average=True)
    expect(every, mine, "gluon parameters equal on every rank")
    deferred = gluon.nn.Dense(3)
    deferred.initialize()
    try:
        bps.broadcast_parameters(deferred.collect_params())
        raise AssertionError("a deferred parameter was accepted")
    except ValueError as exc:
        assert "deferred initialization" in str(exc), exc
    try:
        bps.broadcast_parameters([mx.nd.ones(1)])
        raise AssertionError("a list was accepted")
    except ValueError as exc:
        assert "Received: list" in str(exc), exc


def check_kvstore_sums_over_devices_and_ranks(r, n):
    kv = bps.KVStore(name="kv.check")
    assert (kv.type, kv.rank, kv.num_workers) == ("bpstrain", r, n)
    assert not kv.is_capable("optimizer")
    devices = [mx.nd.ones((2,), ctx=mx.cpu(0)) * (r + 1), mx.nd.ones((2,), ctx=mx.cpu(1)) * 2]
    kv.pushpull(3, devices)
    for d in devices:  # every device gets sum over ranks of (r + 1 + 2)
        expect(d, [n * (n + 1) / 2 + 2 * n] * 2, "pushpull over devices")
    out = [mx.nd.zeros((1,)), mx.nd.zeros((1,))]
    kv.pushpull(["a", "b"], [mx.nd.ones((1,)) * r, mx.nd.ones((1,))], out=out)
    expect(out[0], [n * (n - 1) / 2], "key list a")
    expect(out[1], [n], "key list b")
    dst = [mx.nd.zeros((2,)), mx.nd.zeros((2,))]
    bps.KVStore(root_rank=n - 1, name="kv.root").broadcast(0, mx.nd.ones((2,)) * r, dst)
    for d in dst:
        expect(d, [n - 1] * 2, "kvstore broadcast")


def _data(n, batch):
    rng = np.random.RandomState(123)
    return rng.randn(n * batch, 6), rng.randn(n * batch, 3)


def _mlp(seed):
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu", in_units=6), gluon.nn.Dense(3, in_units=16))
    net.cast("float64")
    net.initialize(mx.init.Xavier())
    return net


def _train(net, trainer, x, y, batch_size, steps=5):
    loss_fn = gluon.loss.L2Loss()
    x, y = mx.nd.array(x, dtype="float64"), mx.nd.array(y, dtype="float64")
    for _ in range(steps):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(batch_size)


def _params(net):
    return [p.data().asnumpy() for _, p in sorted(net.collect_params().items())]


def check_equivalence_n_workers_vs_one_process(r, n):
    """N workers x batch B equal one process with batch N*B, 5 steps (SGD+momentum, Adam)."""
    batch = 4
    x, y = _data(n, batch)
    mine = slice(r * batch, (r + 1) * batch)
    optimizers = {"sgd": ("sgd", {"learning_rate": 0.1, "momentum": 0.9}),
                  "adam": ("adam", {"learning_rate": 0.01})}
    for kind, (opt, opt_params) in optimizers.items():
        # DistributedTrainer broadcasts rank 0's parameters when created, so ranks may
        # start apart; gluon.Trainer broadcasts at the first step, after the gradients.
        variants = {
            "DistributedTrainer": (lambda ps: bps.DistributedTrainer(ps, opt, dict(opt_params)),
                                   batch, 1000 + r),
            "KVStore(average=True)": (lambda ps: gluon.Trainer(
                ps, opt, dict(opt_params), kvstore=bps.KVStore(average=True),
                update_on_kvstore=False), batch, 0),
            "KVStore() sums": (lambda ps: gluon.Trainer(
                ps, opt, dict(opt_params), kvstore=bps.KVStore()), batch * n, 0),
            "DistributedOptimizer": (lambda ps: gluon.Trainer(
                ps, bps.DistributedOptimizer(mx.optimizer.create(opt, **opt_params)),
                kvstore=None), batch, 0),
        }
        for variant, (make, step_batch, seed) in variants.items():
            ref = _mlp(seed=0)
            _train(ref, gluon.Trainer(ref.collect_params(), opt, dict(opt_params), kvstore=None),
                   x, y, n * batch)
            net = _mlp(seed=0 if r == 0 else seed)
            _train(net, make(net.collect_params()), x[mine], y[mine], step_batch)
            diff = max(np.abs(a - b).max() for a, b in zip(_params(ref), _params(net)))
            assert diff < 1e-10, (kind, variant, diff)


def check_trainer_allreduce_then_update_and_refusals(r, n):
    net = _mlp(seed=r)
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.0})
    x = mx.nd.ones((2, 6), dtype="float64") * (r + 1)
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    trainer.allreduce_grads()  # broadcasts rank 0's parameters first, then averages
    grads = np.concatenate([p.grad().asnumpy().ravel() for _, p in
                            sorted(net.collect_params().items())])
    expect(bps.push_pull(mx.nd.array(grads, dtype="float64"), name="grads.check"), grads,
           "averaged gradients equal on every rank")
    trainer.update(2)
    try:
        bps.DistributedTrainer(net.collect_params(), "sgd", compression_params={"fp16": True})
        raise AssertionError("compression_params were accepted")
    except ValueError as exc:
        assert "Received: compression_params" in str(exc), exc


def check_distributed_optimizer_with_module_api(r, n):
    """BytePS's Module recipe: broadcast_parameters, then a DistributedOptimizer (kvstore=None)."""
    batch = 4
    x, y = _data(n, batch)
    net = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=3, name="fc")
    net = mx.sym.LinearRegressionOutput(net, mx.sym.var("label"), name="out")

    def module(data, label, seed, opt):
        mx.random.seed(seed)
        it = mx.io.NDArrayIter(data, label, batch_size=len(data), label_name="label")
        mod = mx.mod.Module(net, data_names=["data"], label_names=["label"])
        mod.bind(data_shapes=it.provide_data, label_shapes=it.provide_label)
        mod.init_params(mx.init.Xavier())
        mod.init_optimizer(kvstore=None, optimizer=opt)
        return mod, it

    ref, ref_it = module(x, y, 0, mx.optimizer.SGD(learning_rate=0.1, momentum=0.9,
                                                   rescale_grad=1.0 / (n * batch)))
    opt = bps.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9,
                                                    rescale_grad=1.0 / batch))
    mine = slice(r * batch, (r + 1) * batch)
    mod, it = module(x[mine], y[mine], r, opt)
    arg, aux = mod.get_params()
    bps.broadcast_parameters(arg, root_rank=0)
    mod.set_params(arg, aux)
    for _ in range(5):
        for m, data in ((ref, ref_it), (mod, it)):
            data.reset()
            m.forward_backward(next(data))
            m.update()
    got, want = mod.get_params()[0], ref.get_params()[0]
    diff = max(np.abs(got[k].asnumpy() - want[k].asnumpy()).max() for k in want)
    assert diff < 1e-5, diff  # float32
    assert opt.learning_rate == 0.1 and pickle.loads(pickle.dumps(opt)).momentum == 0.9


def check_mismatch_raises_on_every_rank_and_job_stays_usable(r, n):
    try:
        bps.push_pull(mx.nd.ones((2 + r,)), name="mismatch.shape")
        raise AssertionError("shapes differing across ranks were accepted")
    except MismatchError as exc:
        assert "mismatch.shape" in str(exc), exc
    expect(bps.push_pull(mx.nd.ones((2,)), name="after.mismatch", is_average=False),
           [n, n], "push_pull after a mismatch")


CHECKS = [(name[len("check_"):], func) for name, func in list(globals().items())
          if name.startswith("check_")]


def main():
    bps.init()
    report_checks(CHECKS, bps.rank(), bps.size())
    bps.shutdown()


if __name__ == "__main__":
    main()
