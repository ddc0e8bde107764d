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


def decode(blob: bytes, width: int, num_rows: int, copy: bool = True) -> Tuple[np.ndarray, np.ndarray]:
    """Checks and unpacks an answer (it came off the network); ``copy=False`` gives
    read-only views of ``blob``."""
    row_bytes = 8 + 4 * width
    if len(blob) % row_bytes:
        raise ValueError(f"a sparse answer of {len(blob)} bytes is not whole rows of width {width}")
    count = len(blob) // row_bytes
    raw = np.frombuffer(blob, np.uint8)
    ids = raw[:count * 8].view(np.int64)
    if count and (ids[0] < 0 or ids[-1] >= num_rows or np.any(np.diff(ids) <= 0)):
        raise ValueError("a sparse answer whose ids are not ascending within "
                         f"[0, {num_rows})")
    rows = raw[count * 8:].view(np.float32).reshape(count, width)
    return (ids.copy(), rows.copy()) if copy else (ids, rows)


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
        shard_of = ids % shards
        for s in range(shards):
            mine = shard_of == s
            handles.append(_enqueue_shard(f"{name}.rows{s}", width, encode(ids[mine], rows[mine]), priority))
    return Pending(ids, rows, width, num_rows, average, handles)


def finish(pending: Pending) -> Tuple[np.ndarray, np.ndarray]:
    """Waits for a started push_pull; returns ``(ids, rows)`` of the union."""
    if not pending.handles:  # a single process: its own rows
        return pending.ids, pending.rows
    parts = [decode(engine.synchronize(h), pending.width, pending.num_rows, copy=False) for h in pending.handles]
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
