"""Row-sparse push_pull for embedding-like tables (numpy; the adapters build on it).

    ids, rows = sparse_push_pull(ids, rows, name="emb", num_rows=4_000_000)

A worker sends only the rows it touched: duplicate ids are summed here first, the rows
are cut into one shard per server by ``id % num_servers`` (so the load spreads with the
ids), each shard travels as (ids ascending, rows) and its server merges the shards of
every worker by id (core_ext/src/sparse_rows.h). Every worker gets the union back:
sorted ids and their rows, summed over workers and divided by the worker count when
``average``; rows nobody touched are not sent at all. Collective: every rank calls it
for the same name in the same order (with any number of rows, none included).
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

from bpstrain import engine


def combine_duplicates(ids, rows) -> Tuple[np.ndarray, np.ndarray]:
    """Unique ids ascending and the sum of each id's rows (float32)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[0] != ids.shape[0]:
        raise ValueError("rows must be (len(ids), width). Received: ids "
                         f"{ids.shape}, rows {rows.shape}")
    if ids.size < 2 or bool(np.all(ids[1:] > ids[:-1])):  # already coalesced (torch's coalesce)
        return ids, np.ascontiguousarray(rows)
    unique, inverse = np.unique(ids, return_inverse=True)
    if unique.shape[0] == ids.shape[0]:
        order = np.argsort(ids, kind="stable")
        return ids[order], np.ascontiguousarray(rows[order])
    summed = np.zeros((unique.shape[0], rows.shape[1]), np.float32)
    np.add.at(summed, inverse, rows)
    return unique, summed


def encode(ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The wire body: int64 ids then float32 rows, as one uint8 array."""
    return np.concatenate([ids.astype(np.int64).view(np.uint8).reshape(-1),
                           np.ascontiguousarray(rows, np.float32).view(np.uint8).reshape(-1)])


def decode(blob: bytes, width: int, num_rows: int) -> Tuple[np.ndarray, np.ndarray]:
    """Checks and unpacks an answer (it came off the network)."""
    row_bytes = 8 + 4 * width
    if len(blob) % row_bytes:
        raise ValueError(f"a sparse answer of {len(blob)} bytes is not whole rows of width {width}")
    count = len(blob) // row_bytes
    raw = np.frombuffer(blob, np.uint8)
    ids = raw[:count * 8].view(np.int64)
    if count and (ids[0] < 0 or ids[-1] >= num_rows or np.any(np.diff(ids) <= 0)):
        raise ValueError("a sparse answer whose ids are not ascending within "
                         f"[0, {num_rows})")
    return ids.copy(), raw[count * 8:].view(np.float32).reshape(count, width).copy()


def _num_shards() -> int:
    """One shard of every table per server (ids ``% num_servers``)."""
    return max(1, engine.core_worker().num_servers)


def _enqueue_shard(name: str, width: int, body: np.ndarray, priority: int = 0, **options) -> int:
    """Queues one shard's sparse operation; returns its engine handle, whose result
    (:func:`engine.synchronize`) is the answer's bytes."""
    worker = engine.core_worker()
    handle = worker.enqueue_sparse(name, width, body, priority, **options)
    return engine.adopt(handle, body, lambda _: worker.take_sparse_result(handle))


class Pending:
    """A started row-sparse push_pull (:func:`start`); :func:`finish` waits for it."""

    def __init__(self, ids, rows, width, num_rows, average, handles):
        self.ids, self.rows, self.width = ids, rows, width
        self.num_rows, self.average, self.handles = num_rows, average, handles


def start(ids, rows, name: str, num_rows: int, average: bool = True, priority: int = 0) -> Pending:
    """Starts :func:`sparse_push_pull` (every shard's operation queued); returns at once."""
    ids, rows = combine_duplicates(ids, rows)
    if ids.size and (ids[0] < 0 or ids[-1] >= num_rows):
        raise ValueError(f"row ids must be in [0, {num_rows}). Received: {ids[0]} .. {ids[-1]}")
    width = rows.shape[1]
    handles = []
    if engine.env().distributed:
        shards = _num_shards()
        for s in range(shards):
            mine = (ids % shards) == s
            handles.append(_enqueue_shard(f"{name}.rows{s}", width, encode(ids[mine], rows[mine]), priority))
    return Pending(ids, rows, width, num_rows, average, handles)


def finish(pending: Pending) -> Tuple[np.ndarray, np.ndarray]:
    """Waits for a started push_pull; returns ``(ids, rows)`` of the union."""
    if not pending.handles:  # a single process: its own rows
        return pending.ids, pending.rows
    parts = [decode(engine.synchronize(h), pending.width, pending.num_rows) for h in pending.handles]
    out_ids = np.concatenate([p[0] for p in parts])
    out_rows = np.concatenate([p[1] for p in parts]).reshape(-1, pending.width)
    order = np.argsort(out_ids, kind="stable")
    out_ids, out_rows = out_ids[order], out_rows[order]
    if pending.average:
        out_rows *= np.float32(1.0) / np.float32(engine.size())  # as dense averages: x * (1/n)
    return out_ids, out_rows


def sparse_push_pull(ids, rows, name: str, num_rows: int, average: bool = True,
                     priority: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Sums (or averages) rows by id over all ranks; returns ``(ids, rows)`` of the union.

    Args:
        ids: row ids of this rank's rows, in ``[0, num_rows)``, duplicates allowed.
        rows: ``(len(ids), width)`` float32.
        name: the table's name (the same on every rank).
        num_rows: the table's height (ids are checked against it).
    """
    return finish(start(ids, rows, name, num_rows, average, priority))


def initial_rows(ids, width: int, scale: float, seed: int) -> np.ndarray:
    """The rows a table spec ``init=uniform:<scale> seed=<seed>`` starts with (the servers'
    initialiser in core_ext/src/row_table.cc, in numpy: splitmix64, 24 bits, [-a, a))."""
    ids = np.asarray(ids, np.uint64).reshape(-1, 1)
    with np.errstate(over="ignore"):
        x = np.uint64(seed) ^ (ids * np.uint64(width) + np.arange(width, dtype=np.uint64))
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    unit = (x >> np.uint64(40)).astype(np.float32) / np.float32(16777216.0)
    return ((np.float32(2.0) * unit - np.float32(1.0)) * np.float32(scale)).astype(np.float32)


class EmbeddingTable:
    """An embedding table kept by the parameter servers (the workers never hold it).

        table = EmbeddingTable("user_emb", num_rows=40_000_000, width=64, optimizer="adagrad",
                               init_scale=0.01)
        rows = table.pull(ids)             # (len(ids), 64): the current rows, duplicates too
        ...forward, backward to the rows...
        table.push(ids, row_grads, lr=0.05)  # averaged over workers, applied on the servers

    Rows live on server ``id % num_servers``, are created on first touch (zeros, or
    uniform in ``[-init_scale, init_scale)`` from ``seed``, the same wherever and whenever
    they are created), and are updated by sparse SGD or Adagrad (``torch.optim.Adagrad``'s
    rule, its accumulator on the servers) once every worker pushed the step. Both calls
    are collective: every rank calls them for the same table in the same order (each
    with its own ids; a rank may pull no rows), as the servers number a table's
    operations.
    """

    def __init__(self, name: str, num_rows: int, width: int, optimizer: str = "sgd",
                 init_scale: float = 0.0, seed: int = 0, eps: float = 1e-10,
                 initial_accumulator: float = 0.0):
        if optimizer not in ("sgd", "adagrad"):
            raise ValueError(f"optimizer must be 'sgd' or 'adagrad'. Received: {optimizer!r}")
        if num_rows < 1 or width < 1 or init_scale < 0:
            raise ValueError("num_rows and width must be >= 1 and init_scale >= 0. Received: "
                             f"{num_rows}, {width}, {init_scale}")
        self.name, self.num_rows, self.width = name, int(num_rows), int(width)
        init = f"uniform:{float(init_scale)!r}" if init_scale > 0 else "zeros"
        self.spec = (f"init={init} seed={int(seed)} optimizer={optimizer} eps={float(eps)!r} "
                     f"initial_accumulator={float(initial_accumulator)!r}")
        self._version = 0

    def _check(self, ids) -> np.ndarray:
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_rows):
            raise ValueError(f"row ids must be in [0, {self.num_rows}). Received: {ids.min()} .. {ids.max()}")
        return ids

    def pull(self, ids) -> np.ndarray:
        """Collective: the current rows of this rank's ``ids`` (any order, duplicates
        allowed), ``(len(ids), width)``."""
        ids = self._check(ids)
        unique, inverse = np.unique(ids, return_inverse=True)
        shards = _num_shards()
        rows = np.empty((unique.size, self.width), np.float32)
        started = []
        for s in range(shards):
            mine = np.nonzero(unique % shards == s)[0]
            body = np.ascontiguousarray(unique[mine]).view(np.uint8)
            started.append((mine, _enqueue_shard(f"{self.name}.table{s}", self.width, body, param=4,
                                                 table=self.spec)))
        for mine, handle in started:
            got = np.frombuffer(engine.synchronize(handle), np.float32)
            if got.size != mine.size * self.width:
                raise ValueError(f"a table answer of {got.size} values for {mine.size} rows")
            rows[mine] = got.reshape(mine.size, self.width)
        return rows[inverse]

    def push(self, ids, grads, lr: float) -> None:
        """Collective: this rank's gradients of the rows of ``ids`` (duplicates summed);
        the servers average every rank's (ranks that did not touch a row count as zero)
        and apply one optimizer step to each touched row."""
        ids, grads = combine_duplicates(self._check(ids), grads)
        shards = _num_shards()
        handles = []
        for s in range(shards):
            mine = ids % shards == s
            handles.append(_enqueue_shard(f"{self.name}.table{s}", self.width, encode(ids[mine], grads[mine]),
                                          param=5, lr=float(lr), table=self.spec))
        for handle in handles:
            engine.synchronize(handle)
