"""Embedding tables kept by the parameter servers (the storage mode of sparse training).

    from bpstrain.embedding_table import EmbeddingTable
    table = EmbeddingTable("user_emb", num_rows=40_000_000, width=64, optimizer="adagrad",
                           init_scale=0.01)
    rows = table.pull(ids)                 # (len(ids), 64): the current rows, duplicates too
    ...forward, backward to the rows...
    table.push(ids, row_grads, lr=0.05)    # averaged over workers, applied on the servers

    # pipelined: the next batch's rows travel while this step's push is in flight
    handles = table.push_async(ids, row_grads, lr=0.05)
    ahead = table.prefetch(next_ids)       # the rows as of after that push
    rows = table.take(ahead)               # waits for the push; rows it changed are refreshed

The framework layers build on this: ``bpstrain.torch.ServerEmbedding`` /
``ServerEmbeddingBag`` pull in ``forward`` and push from ``backward``.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import numpy as np

from bpstrain import engine
from bpstrain._sparse import _enqueue_shard, _num_shards, combine_duplicates, decode, encode, initial_rows

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
        self._pushes = 0  # push_async calls so far: a prefetch names the push it follows
        self._unwaited: Dict[int, List[int]] = {}  # push number -> its handles, until waited for
        # The prefetch made while that push was in flight: its answers may refresh rows.
        self._refreshed_by_push: Optional[Prefetch] = None

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
        self._pushes += 1
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
        self._unwaited[self._pushes] = handles
        return handles

    def wait(self, handles: List[int]) -> None:
        """Waits for a :meth:`push_async` (the handles it returned)."""
        number = next((n for n, h in self._unwaited.items() if list(h) == list(handles)), None)
        answers = [engine.synchronize(handle) for handle in handles]
        if number is None:
            return
        del self._unwaited[number]
        ahead = self._refreshed_by_push
        if ahead is not None and number == ahead.after:
            ahead.refresh = answers  # the rows the push changed among the prefetch's ids
            self._refreshed_by_push = None

    def prefetch(self, ids) -> "Prefetch":
        """Collective, like :meth:`pull`: starts pulling the rows of ``ids`` as of after
        every push started so far, while the last push may still be in flight, and returns
        at once; :meth:`take` gives the rows. The servers send now the rows that push can
        no longer change, and the rest (the rows it changes) with the push's answer, so
        the next batch's rows travel while this step's gradients do. A prefetch must follow
        the previous push's :meth:`wait` or :meth:`take`: only the last push may be in flight."""
        ids = self.check_ids(ids)
        if ids.size < 2 or bool(np.all(ids[1:] > ids[:-1])):  # unique already (the layers')
            unique, inverse = ids, None
        else:
            unique, inverse = np.unique(ids, return_inverse=True)
        ahead = Prefetch(unique, inverse, self._pushes)
        if any(n < self._pushes for n in self._unwaited):
            raise RuntimeError(f"table {self.name!r}: a prefetch while an earlier push is not waited for "
                               "(only the last push may be in flight)")
        if self._pushes in self._unwaited:  # the push may be in flight: its answer may refresh rows
            if self._refreshed_by_push is not None:
                raise RuntimeError(f"table {self.name!r}: a second prefetch while push {self._pushes} is in flight "
                                   "(take or discard the first, or wait for the push)")
            self._refreshed_by_push = ahead
        if self._local is None:
            shards = _num_shards()
            shard_of = unique % shards
            for s in range(shards):
                mine = np.nonzero(shard_of == s)[0]
                body = np.ascontiguousarray(unique[mine]).view(np.uint8)
                ahead.shards.append((mine, _enqueue_shard(f"{self.name}.table{s}", self.width, body,
                                                          param=_ROWS_PULL, table=self.spec, after=self._pushes)))
        return ahead

    def take(self, ahead: "Prefetch") -> np.ndarray:
        """The rows of a :meth:`prefetch`, ``(len(ids), width)`` in its ids' order; waits
        for the push it follows if nobody did (its answer brings the rows it changed)."""
        if ahead.taken:
            raise RuntimeError(f"table {self.name!r}: this prefetch was taken already")
        ahead.taken = True
        if self._local is not None:
            return ahead.in_order(self._local.read(ahead.unique))
        if ahead.after in self._unwaited:
            self.wait(self._unwaited[ahead.after])
        answers = [engine.synchronize(handle) for _, handle in ahead.shards]
        rows = np.empty((ahead.unique.size, self.width), np.float32)
        filled = np.zeros(ahead.unique.size, bool)
        if self._refreshed_by_push is ahead or ahead.refresh is None:
            if self._refreshed_by_push is ahead:  # a later push started before the one it follows was waited for
                raise RuntimeError(f"table {self.name!r}: the push this prefetch follows was never waited for")
            ahead.refresh = [b""] * len(answers)
        for (mine, _), now, later in zip(ahead.shards, answers, ahead.refresh):
            asked = ahead.unique[mine]
            for blob in (now, later):  # rows as the prefetch found them, then as the push left them
                got_ids, got_rows = decode(blob, self.width, self.num_rows, copy=False)
                at = np.searchsorted(asked, got_ids)
                if got_ids.size and (at[-1] >= asked.size or np.any(asked[np.minimum(at, asked.size - 1)] != got_ids)):
                    raise ValueError(f"table {self.name!r}: a prefetch answer with rows that were not asked for")
                rows[mine[at]] = got_rows
                filled[mine[at]] = True
        if not filled.all():
            raise ValueError(f"table {self.name!r}: the servers left {int((~filled).sum())} rows of a prefetch unanswered")
        return ahead.in_order(rows)

    def discard(self, ahead: "Prefetch") -> None:
        """Drops a :meth:`prefetch` that will not be taken (its operations still finish)."""
        if not ahead.taken:
            ahead.taken = True
            if self._refreshed_by_push is ahead:
                self._refreshed_by_push = None
            for _, handle in ahead.shards:
                engine.synchronize(handle)


class Prefetch:
    """A started :meth:`EmbeddingTable.prefetch`: the unique ids asked, per shard the
    positions among them and the engine handle, and the number of the push it follows."""

    def __init__(self, unique: np.ndarray, inverse: Optional[np.ndarray], after: int):
        self.unique, self.inverse, self.after = unique, inverse, after
        self.shards: List[Tuple[np.ndarray, int]] = []
        self.refresh: Optional[List[bytes]] = None  # the answers of the push it follows, per shard
        self.taken = False

    def in_order(self, rows: np.ndarray) -> np.ndarray:
        """Rows of the unique ids, in the order of the ids asked."""
        return rows if self.inverse is None else rows[self.inverse]


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
