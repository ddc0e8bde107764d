"""Server-held weights (comm.consistency ssp:<s> / async, core_ext/src/param_store.h):
the servers keep rank 0's weights and apply the optimizer with torch.optim's arithmetic;
ssp bounds how far a worker runs ahead of the slowest; async applies every push."""

import threading
import time

import numpy as np
import pytest
import torch

from bpstrain.errors import BpsError, ConfigError
from tests.engine.harness import InProcessCluster, wait

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("transport")]

SUM, BROADCAST = 0, 2
N = 300  # elements: several partitions of 256 bytes over the servers


def init(w, name, weights, optimizer="sgd"):
    """The init round: every rank takes part, rank 0's weights win."""
    out = np.empty_like(weights)
    h = w.enqueue(name, "float32", list(weights.shape), weights, out, BROADCAST, 0, param=1,
                  server_optimizer=optimizer)
    wait(w, h)
    return out


def update_async(w, name, grad, lr):
    """Returns (handle, output): keep the output referenced until the handle is done (the
    raw binding writes the answer there)."""
    out = np.empty_like(grad)
    return w.enqueue(name, "float32", list(grad.shape), grad, out, SUM, param=2, lr=lr), out


def update(w, name, grad, lr):
    h, out = update_async(w, name, grad, lr)
    wait(w, h)
    return out


def grads(rank, step, n=N):
    return np.random.default_rng(100 * step + rank).standard_normal(n).astype(np.float32)


def torch_reference(optimizer_cls, w0, mean_grads, lr, **kw):
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = optimizer_cls([p], lr=lr, **kw)
    for g in mean_grads:
        p.grad = torch.from_numpy(g)
        opt.step()
    return p.detach().numpy()


def mean_of(gs):
    # The servers' arithmetic: arrival-order sum (commutative for two), times 1/n.
    total = gs[0].copy()
    for g in gs[1:]:
        total += g
    return total * np.float32(1.0 / len(gs))


def test_weights_start_from_rank_0_and_async_lr_0_keeps_them_exactly():
    with InProcessCluster(3, 2, partition_bytes=256, consistency="async") as c:
        def job(rank, w):
            start = init(w, "p", np.full(N, rank + 7.5, np.float32))  # only rank 0's counts
            outs = [update(w, "p", grads(rank, s), 0.0) for s in range(5)]
            return start, outs, w.stats()

        for start, outs, stats in c.run_all(job):
            np.testing.assert_array_equal(start, np.full(N, 7.5, np.float32))
            for out in outs:
                np.testing.assert_array_equal(out, start)
            assert stats["weight_answers"] == 5 * len(c.workers[0].partitions("p"))


@pytest.mark.parametrize("kw", [dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=1e-3),
                                dict(momentum=0.5, dampening=0.1), dict()])
def test_ssp0_sgd_equals_torch_sgd_on_the_mean_gradient_bit_for_bit(kw):
    spec = "sgd " + " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in kw.items())
    w0 = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    steps, lr = 6, 0.05
    with InProcessCluster(2, 2, partition_bytes=256, consistency="ssp:0") as c:
        def job(rank, w):
            init(w, "p", w0 if rank == 0 else np.zeros(N, np.float32), spec)
            return [update(w, "p", grads(rank, s), lr) for s in range(steps)]

        res = c.run_all(job)
    expected = torch_reference(torch.optim.SGD, w0, [mean_of([grads(r, s) for r in range(2)])
                                                      for s in range(steps)], lr, **kw)
    np.testing.assert_array_equal(res[0][-1], expected)
    np.testing.assert_array_equal(res[1][-1], expected)


def test_ssp0_adam_follows_torch_adam():
    w0 = np.random.default_rng(2).standard_normal(N).astype(np.float32)
    steps, lr = 8, 0.01
    with InProcessCluster(2, 1, partition_bytes=256, consistency="ssp:0") as c:
        def job(rank, w):
            init(w, "p", w0, "adam beta1=0.9 beta2=0.99 eps=1e-8 weight_decay=0.01")
            return [update(w, "p", grads(rank, s), lr) for s in range(steps)][-1]

        res = c.run_all(job)
    expected = torch_reference(torch.optim.Adam, w0, [mean_of([grads(r, s) for r in range(2)])
                                                       for s in range(steps)], lr,
                               betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    np.testing.assert_allclose(res[0], expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(res[0], res[1])


def test_ssp_lets_a_worker_run_s_clocks_ahead_and_no_further():
    s, lr = 2, 0.1
    w0 = np.zeros(N, np.float32)
    with InProcessCluster(2, 1, consistency=f"ssp:{s}") as c:
        fast, slow = c.workers
        for w in c.workers:
            threading.Thread(target=init, args=(w, "p", w0)).start()
        time.sleep(0.5)
        g = np.ones(N, np.float32)
        # Clocks 1..s are answered at once, with the initial weights (nothing applied yet).
        for _ in range(s):
            np.testing.assert_array_equal(update(fast, "p", g, lr), w0)
        h, out = update_async(fast, "p", g, lr)  # clock s + 1 waits for the slow worker
        assert not fast.wait(h, 0.5)
        # The slow worker's clock 1 completes clock 1: the fast one gets w0 - lr * mean.
        np.testing.assert_array_equal(update(slow, "p", 3 * g, lr), w0 - np.float32(lr) * 2)
        wait(fast, h)
        np.testing.assert_array_equal(out, w0 - np.float32(lr) * 2)
        assert fast.stats()["max_staleness"] == s  # its clocks 1..s were not in the weights
        assert slow.stats()["max_staleness"] == 0


def test_async_applies_each_push_at_once_with_lr_over_n():
    lr = 0.2
    with InProcessCluster(2, 1, consistency="async") as c:
        a, b = c.workers
        threads = [threading.Thread(target=init, args=(w, "p", np.zeros(N, np.float32))) for w in c.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        g = np.ones(N, np.float32)
        first = update(a, "p", g, lr)
        second = update(a, "p", g, lr)  # no waiting for b
        third = update(b, "p", 4 * g, lr)
        step = np.float32(lr / 2)
        np.testing.assert_array_equal(first, np.full(N, -step, np.float32))
        np.testing.assert_array_equal(second, np.full(N, -2 * step, np.float32))
        np.testing.assert_array_equal(third, np.full(N, -6 * step, np.float32))
        assert b.stats()["max_staleness"] == 2  # two updates since b read (at init)


def test_bad_uses_fail_clearly_and_the_job_goes_on():
    with InProcessCluster(2, 1, consistency="ssp:0") as c:
        a, b = c.workers
        g = np.ones(N, np.float32)
        def uninitialised(rank, w):
            with pytest.raises(BpsError, match="weights the servers do not hold"):
                update(w, "never_initialised", g, 0.1)

        c.run_all(uninitialised)
        with pytest.raises(ConfigError, match="need fp32 tensors"):
            a.enqueue("h", "float16", [N], g.astype(np.float16), np.empty(N, np.float16), SUM, param=2, lr=0.1)
        with pytest.raises(ConfigError, match="server optimizer must be 'sgd' or 'adam'"):
            a.enqueue("p", "float32", [N], g, np.empty_like(g), BROADCAST, 0, param=1, server_optimizer="rmsprop")
        with pytest.raises(ConfigError, match="learning rate"):
            a.enqueue("p", "float32", [N], g, np.empty_like(g), SUM, param=2, lr=-1.0)

        # Ranks that disagree on the optimizer: both get an error, nobody gets weights.
        def disagree(rank, w):
            with pytest.raises(BpsError, match="ranks disagree on the server-held weights"):
                init(w, "q", g, "sgd momentum=0.9" if rank == 0 else "sgd")
            return init(w, "q", g, "sgd")  # and the same init again works

        for out in c.run_all(disagree):
            np.testing.assert_array_equal(out, g)
        # A worker that pushes again before its answer (ssp:0) is refused, not queued.
        h1, out1 = update_async(a, "q", g, 0.1)
        h2, out2 = update_async(a, "q", g, 0.1)
        with pytest.raises(BpsError, match="allows no push before the previous one is answered"):
            wait(a, h2)
        update(b, "q", g, 0.1)
        wait(a, h1)
        np.testing.assert_array_equal(out1, g - np.float32(0.1))


def test_consistency_is_checked_at_worker_creation():
    from bpstrain import _core

    with pytest.raises(ConfigError, match="comm.consistency must be"):
        _core.Worker("127.0.0.1", 1, consistency="eventual")
    with pytest.raises(ConfigError, match="k-of-n is for synchronous training"):
        _core.Worker("127.0.0.1", 1, consistency="async", aggregate=2)
    with pytest.raises(ConfigError, match="comm.consistency is sync"):
        with InProcessCluster(1, 1) as c:
            g = np.ones(4, np.float32)
            c.workers[0].enqueue("p", "float32", [4], g, np.empty_like(g), SUM, param=2, lr=0.1)


def test_a_worker_that_dies_fails_the_ones_waiting_for_it_with_its_name():
    from bpstrain.errors import PeerError

    c = InProcessCluster(3, 1, consistency="ssp:0")
    threads = [threading.Thread(target=init, args=(w, "p", np.zeros(N, np.float32))) for w in c.workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pending = [update_async(w, "p", np.ones(N, np.float32), 0.1) for w in c.workers[:2]]
    waiting = [h for h, _ in pending]  # (the outputs stay referenced in `pending`)
    time.sleep(0.2)
    assert not any(w.poll(h) for w, h in zip(c.workers, waiting))  # ssp:0 waits for worker 2
    c.workers[2].shutdown("RuntimeError: killed by the test")
    for w, h in zip(c.workers, waiting):
        with pytest.raises(PeerError, match="worker 2.*killed by the test"):
            wait(w, h, timeout=10)
    with pytest.raises(PeerError):
        c.close()
