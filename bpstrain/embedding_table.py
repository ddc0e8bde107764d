"""Embedding tables kept by the parameter servers (the storage mode of sparse training).

    from bpstrain.embedding_table import EmbeddingTable
    table = EmbeddingTable("user_emb", num_rows=40_000_000, width=64, optimizer="adagrad",
                           init_scale=0.01)
    rows = table.pull(ids)                 # (len(ids), 64): the current rows, duplicates too
    ...forward, backward to the rows...
    table.push(ids, row_grads, lr=0.05)    # averaged over workers, applied on the servers

The framework layers build on this: ``bpstrain.torch.ServerEmbedding`` /
``ServerEmbeddingBag`` pull in ``forward`` and push from ``backward``.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import numpy as np

from bpstrain import engine
from bpstrain._sparse import _enqueue_shard, _num_shards, combine_duplicates, encode, initial_rows

OPTIMIZERS = ("sgd", "adagrad", "adam")
_ROWS_PULL, _ROWS_PUSH = 4, 5  # the push meta's ParamOp (core_ext/src/protocol.h)


class EmbeddingTable:
    """An embedding table kept by the parameter servers: the workers never hold it.

    Rows live on server ``id % num_servers``, are created on first touch (zeros, or
    uniform in ``[-init_scale, init_scale)`` from ``seed``, the same wherever and whenever
    they are created), and are updated by sparse SGD or Adagrad (``torch.optim.Adagrad``'s
    rule with no decay, its accumulator on the servers) once every worker pushed the step.
    Both calls are collective: every rank calls them for the same table in the same
    order (each with its own ids; a rank may pull or push no rows), as the servers number
    a table's operations. A push is answered once the step is applied, so a pull after a
    finished push sees it.

    In a single process (no servers) the table lives in this process instead (only the
    rows touched so far), with the same initialiser and optimizers.

    Args:
        name: the table's name, the same on every rank.
        num_rows, width: the table's shape (ids are checked against ``num_rows``).
        optimizer: ``"sgd"``, ``"adagrad"`` or ``"adam"``.
        init_scale: ``a`` of the uniform initialiser; 0 starts every row at zeros.
        seed: the initialiser's seed.
        eps: Adagrad's or Adam's (default 1e-10 for Adagrad, 1e-8 for Adam, as torch).
        initial_accumulator: Adagrad's ``initial_accumulator_value``.
        betas: Adam's ``(beta1, beta2)``.
    """

    def __init__(self, name: str, num_rows: int, width: int, optimizer: str = "sgd",
                 init_scale: float = 0.0, seed: int = 0, eps: Optional[float] = None,
                 initial_accumulator: float = 0.0, betas: Tuple[float, float] = (0.9, 0.999)):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}. Received: {optimizer!r}")
        if eps is None:
            eps = 1e-8 if optimizer == "adam" else 1e-10
        betas = tuple(float(b) for b in betas)
        if (num_rows < 1 or width < 1 or init_scale < 0 or eps <= 0 or initial_accumulator < 0
                or len(betas) != 2 or not all(0 <= b < 1 for b in betas)):
            raise ValueError("num_rows and width must be >= 1, init_scale and initial_accumulator >= 0, "
                             f"eps > 0 and betas two numbers in [0, 1). Received: {num_rows}, {width}, "
                             f"{init_scale}, {initial_accumulator}, {eps}, {betas}")
        self.name, self.num_rows, self.width = name, int(num_rows), int(width)
        self.optimizer, self.init_scale, self.seed = optimizer, float(init_scale), int(seed)
        self.eps, self.initial_accumulator, self.betas = float(eps), float(initial_accumulator), betas
        init = f"uniform:{self.init_scale!r}" if self.init_scale > 0 else "zeros"
        self.spec = (f"init={init} seed={self.seed} optimizer={optimizer} eps={self.eps!r} "
                     f"initial_accumulator={self.initial_accumulator!r} beta1={betas[0]!r} beta2={betas[1]!r}")
        self._local_rows = None

    @property
    def _local(self):
        """The table of a single process, or None when servers keep it (decided at the
        first operation: the engine may start after the table is declared)."""
        if self._local_rows is None and not engine.env().distributed:
            self._local_rows = _LocalRows(self)
        return self._local_rows

    def check_ids(self, ids) -> np.ndarray:
        """``ids`` as a flat int64 array, checked to lie in ``[0, num_rows)``."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_rows):
            raise ValueError(f"row ids must be in [0, {self.num_rows}). Received: {ids.min()} .. {ids.max()}")
        return ids

    def pull(self, ids) -> np.ndarray:
        """Collective: the current rows of this rank's ``ids`` (any order, duplicates
        allowed), ``(len(ids), width)`` float32."""
        unique, inverse = np.unique(self.check_ids(ids), return_inverse=True)
        return self.pull_unique(unique)[inverse]

    def pull_unique(self, unique: np.ndarray) -> np.ndarray:
        """Collective: :meth:`pull` for ids already unique and ascending (int64, in range)."""
        if self._local is not None:
            return self._local.read(unique)
        shards = _num_shards()
        shard_of = unique % shards
        rows = np.empty((unique.size, self.width), np.float32)
        started = []
        for s in range(shards):
            mine = np.nonzero(shard_of == s)[0]
            body = np.ascontiguousarray(unique[mine]).view(np.uint8)
            started.append((mine, _enqueue_shard(f"{self.name}.table{s}", self.width, body, param=_ROWS_PULL,
                                                 table=self.spec)))
        for mine, handle in started:
            got = np.frombuffer(engine.synchronize(handle), np.float32)
            if got.size != mine.size * self.width:
                raise ValueError(f"a table answer of {got.size} values for {mine.size} rows")
            rows[mine] = got.reshape(mine.size, self.width)
        return rows

    def push(self, ids, grads, lr: float) -> None:
        """Collective: this rank's gradients of the rows of ``ids`` (duplicates summed);
        the servers average every rank's (ranks that did not touch a row count as zero)
        and apply one optimizer step to each touched row. Returns once it is applied."""
        self.wait(self.push_async(ids, grads, lr))

    def push_async(self, ids, grads, lr: float) -> List[int]:
        """Starts :meth:`push`; returns the handles that :meth:`wait` finishes."""
        ids, grads = combine_duplicates(self.check_ids(ids), grads)
        if grads.shape[1] != self.width:
            raise ValueError(f"gradients of table {self.name!r} must be (len(ids), {self.width}). "
                             f"Received: {grads.shape}")
        if self._local is not None:
            self._local.apply(ids, grads, lr)
            return []
        shards = _num_shards()
        shard_of = ids % shards
        handles = []
        for s in range(shards):
            mine = shard_of == s
            handles.append(_enqueue_shard(f"{self.name}.table{s}", self.width, encode(ids[mine], grads[mine]),
                                          param=_ROWS_PUSH, lr=float(lr), table=self.spec))
        return handles

    @staticmethod
    def wait(handles: List[int]) -> None:
        """Waits for a :meth:`push_async`."""
        for handle in handles:
            engine.synchronize(handle)


class _LocalRows:
    """A single process's table (core_ext/src/row_table.cc's rules, in numpy): rows are
    created on first touch and stored in the order they came, found by a sorted index,
    so memory grows with the touched rows only."""

    def __init__(self, table: EmbeddingTable):
        self.table = table
        self.known = np.empty(0, np.int64)  # touched ids, ascending
        self.slot_of = np.empty(0, np.int64)  # their rows' places in self.rows
        self.rows = np.empty((0, table.width), np.float32)
        # Adagrad's accumulators, or Adam's first moments (second moments in accum2)
        self.accum = self.rows.copy() if table.optimizer != "sgd" else None
        self.accum2 = self.rows.copy() if table.optimizer == "adam" else None
        self.steps = 0

    def _slots(self, ids: np.ndarray) -> np.ndarray:
        """The places of ``ids`` (unique) in ``self.rows``, creating the new ones."""
        pos = np.searchsorted(self.known, ids)
        fresh = ids
        if self.known.size:
            fresh = ids[self.known[np.minimum(pos, self.known.size - 1)] != ids]
        if fresh.size:
            t = self.table
            start = self.rows.shape[0]
            new_rows = (initial_rows(fresh, t.width, t.init_scale, t.seed) if t.init_scale > 0
                        else np.zeros((fresh.size, t.width), np.float32))
            self.rows = np.concatenate([self.rows, new_rows])
            if self.accum is not None:
                start_value = t.initial_accumulator if t.optimizer == "adagrad" else 0.0
                self.accum = np.concatenate([self.accum, np.full_like(new_rows, start_value)])
            if self.accum2 is not None:
                self.accum2 = np.concatenate([self.accum2, np.zeros_like(new_rows)])
            at = np.searchsorted(self.known, fresh)
            self.known = np.insert(self.known, at, fresh)
            self.slot_of = np.insert(self.slot_of, at, np.arange(start, start + fresh.size))
            pos = np.searchsorted(self.known, ids)
        return self.slot_of[pos]

    def read(self, ids: np.ndarray) -> np.ndarray:
        slots = self._slots(ids)  # first: it may replace self.rows
        return self.rows[slots]

    def apply(self, ids: np.ndarray, grads: np.ndarray, lr: float) -> None:
        self.steps += 1
        slots = self._slots(ids)
        t = self.table
        if t.optimizer == "sgd":
            self.rows[slots] -= np.float32(lr) * grads
        elif t.optimizer == "adagrad":
            self.accum[slots] += grads * grads
            self.rows[slots] -= np.float32(lr) * grads / (np.sqrt(self.accum[slots]) + np.float32(t.eps))
        else:  # torch.optim.SparseAdam's operations (row_table.cc)
            beta1, beta2 = t.betas
            m, v = self.accum[slots], self.accum2[slots]
            dm = (grads - m) * np.float32(1 - beta1)
            dv = (grads * grads - v) * np.float32(1 - beta2)
            numer, denom = dm + m, np.sqrt(dv + v) + np.float32(t.eps)
            self.accum[slots], self.accum2[slots] = m + dm, v + dv
            step = lr * math.sqrt(1 - beta2 ** self.steps) / (1 - beta1 ** self.steps)
            self.rows[slots] += np.float32(-step) * (numer / denom)
