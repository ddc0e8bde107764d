"""Row-sparse push_pull (core_ext/src/sparse_rows.h, bpstrain/_sparse.py): workers send
only the rows they touched, servers merge them by id, everyone gets the union; equal to a
dense push_pull on the touched rows, untouched rows never travel."""

import numpy as np
import pytest

from bpstrain import _sparse
from bpstrain.errors import BpsError, ConfigError
from tests.engine.harness import InProcessCluster, push_pull, wait

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("transport")]

ROWS, WIDTH = 1000, 8


def sparse(worker, name, ids, rows):
    """One rank's row-sparse push_pull over every server shard (as _sparse does)."""
    ids, rows = _sparse.combine_duplicates(ids, rows)
    shards = worker.num_servers
    handles = []
    for s in range(shards):
        mine = ids % shards == s
        body = _sparse.encode(ids[mine], rows[mine])
        handles.append((worker.enqueue_sparse(f"{name}.rows{s}", WIDTH, body), body))
    parts = []
    for h, _body in handles:
        wait(worker, h)
        parts.append(_sparse.decode(worker.take_sparse_result(h), WIDTH, ROWS))
    out_ids = np.concatenate([p[0] for p in parts])
    order = np.argsort(out_ids)
    return out_ids[order], np.concatenate([p[1] for p in parts])[order]


def touched(rank, step=0):
    rng = np.random.default_rng(10 * rank + step)
    ids = rng.zipf(1.3, 60) % ROWS  # skewed, with duplicates
    # Small integers: sums are exact in any order, so sparse and dense agree bit for bit.
    return ids, rng.integers(-4, 5, (60, WIDTH)).astype(np.float32)


@pytest.mark.parametrize("workers, servers", [(2, 1), (3, 2)])
def test_sparse_equals_dense_on_touched_rows_and_sends_no_other(workers, servers):
    with InProcessCluster(workers, servers) as c:
        def job(rank, w):
            out = []
            for step in range(3):
                ids, rows = touched(rank, step)
                got = sparse(w, "emb", ids, rows)
                dense = np.zeros((ROWS, WIDTH), np.float32)
                np.add.at(dense, ids, rows)
                out.append((got, push_pull(w, f"dense{step}", dense)))
            return out

        results = c.run_all(job)
        # The shards spread over the servers (one shard per server, by id).
        owners = {c.workers[0].partitions(f"emb.rows{s}")[0][2] for s in range(servers)}
        assert owners == set(range(servers)), owners
    for step in range(3):
        union = np.unique(np.concatenate([touched(r, step)[0] for r in range(workers)]))
        (ids, rows), dense = results[0][step]
        np.testing.assert_array_equal(ids, union)
        np.testing.assert_array_equal(rows, dense[union])  # bitwise on the touched rows
        assert not dense[np.setdiff1d(np.arange(ROWS), union)].any()
        for other in results[1:]:  # every rank got the same answer
            np.testing.assert_array_equal(other[step][0][0], ids)
            np.testing.assert_array_equal(other[step][0][1], rows)


def test_a_rank_without_rows_still_takes_part_and_gets_the_others():
    with InProcessCluster(2, 1) as c:
        def job(rank, w):
            if rank == 0:
                return sparse(w, "emb", np.array([5, 3, 5]), np.ones((3, WIDTH), np.float32))
            return sparse(w, "emb", np.zeros(0, np.int64), np.zeros((0, WIDTH), np.float32))

        for ids, rows in c.run_all(job):
            np.testing.assert_array_equal(ids, [3, 5])
            np.testing.assert_array_equal(rows, [[1] * WIDTH, [2] * WIDTH])


def test_bad_sparse_pushes_fail_clearly():
    with InProcessCluster(2, 1) as c:
        a, b = c.workers
        unsorted = np.concatenate([np.array([7, 2], np.int64).view(np.uint8),
                                   np.ones(2 * WIDTH, np.float32).view(np.uint8)])

        def job(rank, w):
            body = unsorted if rank == 0 else _sparse.encode(np.array([1]), np.ones((1, WIDTH), np.float32))
            h = w.enqueue_sparse("bad.rows0", WIDTH, body)
            if rank == 0:
                with pytest.raises(BpsError, match="not non-negative and strictly ascending"):
                    wait(w, h)
                return None
            with pytest.raises(TimeoutError):  # rank 0's push was refused: the round waits
                wait(w, h, timeout=1.0)
            return None

        c.run_all(job)
        with pytest.raises(ConfigError, match="not whole rows"):
            a.enqueue_sparse("odd.rows0", WIDTH, np.zeros(13, np.uint8))
        with pytest.raises(ConfigError, match="row_width must be >= 1"):
            a.enqueue_sparse("zero.rows0", 0, np.zeros(0, np.uint8))
    with pytest.raises(ValueError, match="not ascending"):
        _sparse.decode(np.array([3, 1], np.int64).tobytes() + bytes(8 * WIDTH), WIDTH, ROWS)
    with pytest.raises(ValueError, match="rows must be"):
        _sparse.combine_duplicates([1, 2], np.ones((3, WIDTH)))


def test_table_specs_are_checked_before_they_travel():
    """The worker refuses a bad table spec at enqueue (the servers check it again)."""
    with InProcessCluster(1, 1) as c:
        (w,) = c.workers
        ids = np.array([1, 2], np.int64).view(np.uint8)
        for spec, why in (("init=zeros seed=0 optimizer=adam beta1=1.5", "beta1=<b>"),
                          ("init=zeros seed=0 optimizer=rmsprop", "optimizer=sgd|adagrad|adam"),
                          ("init=zeros seed=0 optimizer=adam beta2=-0.1", "0 <= b < 1")):
            with pytest.raises(ConfigError, match=why):
                w.enqueue_sparse("spec.table0", WIDTH, ids, 0, param=4, table=spec)
        ok = w.enqueue_sparse("spec.table0", WIDTH, ids, 0, param=4,
                              table="init=zeros seed=0 optimizer=adam eps=1e-08 beta1=0.8 beta2=0.99")
        wait(w, ok)
        assert np.frombuffer(w.take_sparse_result(ok), np.float32).size == 2 * WIDTH


def test_a_table_prefetch_is_answered_at_once_and_refreshed_by_the_push_it_follows():
    """A prefetch asked while its push's round is open gets, at once, the rows that round
    has not touched; the push's answer to that worker brings the rest, updated. A
    prefetch more than one push ahead, or of a table push, is refused."""
    spec = "init=zeros seed=0 optimizer=sgd"
    ids = np.array([1, 2, 5], np.int64)
    with InProcessCluster(2, 1) as c:
        a, b = c.workers
        first = [w.enqueue_sparse("pf.table0", WIDTH, ids.view(np.uint8), 0, param=4, table=spec) for w in (a, b)]
        for w, h in zip((a, b), first):  # both ranks declared the table
            wait(w, h)
        grads = _sparse.encode(np.array([2]), np.ones((1, WIDTH), np.float32))
        push_a = a.enqueue_sparse("pf.table0", WIDTH, grads, 0, param=5, lr=0.5, table=spec)
        ahead = a.enqueue_sparse("pf.table0", WIDTH, ids.view(np.uint8), 0, param=4, table=spec, after=1)
        wait(a, ahead)  # answered before b pushed: the round is open
        now_ids, now_rows = _sparse.decode(a.take_sparse_result(ahead), WIDTH, ROWS)
        # Row 2 (pushed into the open round) is held back — unless the server saw the
        # prefetch first; every row it sent now is still zeros.
        assert set(now_ids) <= {1, 2, 5} and {1, 5} <= set(now_ids) and not now_rows.any()
        push_b = b.enqueue_sparse("pf.table0", WIDTH, _sparse.encode(np.array([7]), np.ones((1, WIDTH), np.float32)),
                                  0, param=5, lr=0.5, table=spec)
        wait(a, push_a)
        wait(b, push_b)
        later_ids, later_rows = _sparse.decode(a.take_sparse_result(push_a), WIDTH, ROWS)
        assert list(later_ids) == [2] and np.all(later_rows == -0.25)  # -lr * (1 + 0) / 2
        assert b.take_sparse_result(push_b) == b""  # b asked for nothing
        too_far = a.enqueue_sparse("pf.table0", WIDTH, ids.view(np.uint8), 0, param=4, table=spec, after=3)
        with pytest.raises(BpsError, match="only the last push may still be in flight"):
            wait(a, too_far)
        with pytest.raises(ConfigError, match="only a table pull can be a prefetch"):
            a.enqueue_sparse("pf.table0", WIDTH, grads, 0, param=5, lr=0.5, table=spec, after=1)
        fresh = a.enqueue_sparse("pf.table0", WIDTH, ids.view(np.uint8), 0, param=4, table=spec, after=1)
        wait(a, fresh)  # the push it follows is applied: every row, now
        fresh_ids, fresh_rows = _sparse.decode(a.take_sparse_result(fresh), WIDTH, ROWS)
        assert list(fresh_ids) == [1, 2, 5] and np.all(fresh_rows[1] == -0.25) and not fresh_rows[[0, 2]].any()
