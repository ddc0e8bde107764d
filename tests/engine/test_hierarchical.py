"""Hierarchical mode: workers of one host reduce through shared memory, then each local
rank push_pulls only its slice (in-process harness: 'hosts' are groups of workers)."""

import glob

import numpy as np
import pytest

from tests.engine.harness import InProcessCluster, push_pull
from tests.engine.test_engine import DTYPES, contribution, np_dtype

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("transport")]


@pytest.mark.parametrize("workers,local_size,servers", [(4, 2, 2), (2, 2, 1), (3, 3, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_hierarchical_sums_match_flat(workers, local_size, servers, dtype):
    shape = (101,)
    with InProcessCluster(workers, servers, local_size=local_size, hierarchical=True,
                          partition_bytes=64) as c:
        res = c.run_all(lambda r, w: (push_pull(w, "h", contribution(r, dtype, shape), 0),
                                      push_pull(w, "h", contribution(r, dtype, shape), 1)))
    expect = sum(contribution(r, dtype, shape).astype(np.float64) for r in range(workers))
    for total, avg in res:
        np.testing.assert_array_equal(total.astype(np.float64), expect)
        if np.issubdtype(np_dtype(dtype), np.integer):
            np.testing.assert_array_equal(avg.astype(np.float64), np.floor(expect / workers))
        else:
            np.testing.assert_allclose(avg.astype(np.float64), expect / workers, rtol=1e-2)


def test_each_rank_pushes_only_its_slice_and_rounds_in_any_order():
    n = 1 << 16
    with InProcessCluster(4, 2, local_size=2, hierarchical=True) as c:
        def job(rank, w):
            keep, handles = [], []
            names = [f"t{i}" for i in range(6)]
            if rank % 2:
                names.reverse()  # local ranks submit in opposite orders: no deadlock
            for rnd in range(2):
                for name in names:
                    x = np.full(n, rank + rnd, np.float32)
                    out = np.empty_like(x)
                    keep.append((rnd, x, out))
                    handles.append(w.enqueue(name, "float32", [n], x, out, 0, 0, 0))
            from tests.engine.harness import wait
            for h in handles:
                wait(w, h)
            return [(rnd, out) for rnd, _, out in keep], w.stats()

        res = c.run_all(job)
    for outs, stats in res:
        for rnd, out in outs:
            assert np.all(out == 6 + 4 * rnd)
        # 12 ops of n floats; each rank pushes half of each (its slice), not all of it.
        assert stats["bytes_pushed"] == 12 * n * 4 // 2
    assert not glob.glob("/dev/shm/bps*"), "shared segments must not outlive the job"


def test_many_rounds_of_one_new_name_in_flight_keep_their_order():
    """The k-th op on a name gets the k-th round on every rank, also while its declaration
    is in flight: ops queued before the reply and ops enqueued as it lands must not swap
    (a swap gave one rank's op k the result of op k+1)."""
    n, ops = 64, 40
    with InProcessCluster(2, 1, local_size=2, hierarchical=True) as c:
        def job(rank, w):
            from tests.engine.harness import wait
            results = []
            for trial in range(5):  # each trial a new name: its declaration races the ops
                keep = []
                for k in range(ops):
                    x = np.full(n, 1000 * k + rank, np.float32)
                    out = np.empty_like(x)
                    keep.append((k, x, out, w.enqueue(f"fresh{trial}", "float32", [n], x, out, 0, 0, 0)))
                for k, _, out, h in keep:
                    wait(w, h)
                    results.append((k, out.copy()))
            return results

        res = c.run_all(job)
    for results in res:
        for k, out in results:
            assert np.all(out == 2000 * k + 1), (k, out[:2])
