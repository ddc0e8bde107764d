"""Elastic training (``comm.fault_tolerance``): data sharding that follows the job's
membership (:class:`ElasticSampler`), and the state a joining worker gets (:class:`TorchState`).

    sampler = bps.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            ...train step...
            sampler.record_batch(32)      # after the step: these samples are done

Like ``DistributedSampler`` each rank gets an equal share of the epoch's order (padded by
wrapping around, so every rank runs the same number of steps). When a worker leaves, the
samples no rank has consumed yet are dealt again over the workers that remain, in the
middle of the epoch: the departed worker's unfinished share is not lost, and the epoch
still ends on every rank at the same step. Synchronous training consumes batches in
lockstep, so every rank knows how far every other got: its own count. A batch in flight
when a worker left counts as not consumed for that worker (at least once, never dropped).
Every rank deals again at the same step: the one after the first step whose results the
servers computed without the departed worker (``engine.membership()["answered_*"]``, the
same on every rank between two steps), not when each rank happens to hear of it.
Horovod's ``hvd.elastic.ElasticSampler`` has the same interface.
"""

from __future__ import annotations

import contextlib

import math
from typing import Iterator, List

import torch
from torch.utils.data import Sampler

from bpstrain import engine


class ElasticSampler(Sampler):
    """Each rank's share of an epoch, dealt again over the remaining ranks when workers leave.

    Args:
        dataset: anything with ``len()``.
        shuffle: a new order each epoch (seeded by ``seed + epoch``, the same on every rank).
        seed: the shuffle's seed.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.num_samples_total = len(dataset)
        if self.num_samples_total == 0:
            raise ValueError("ElasticSampler needs a non-empty dataset. Received: len=0")
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.epoch = 0
        self._remaining: List[int] = []  # the epoch's samples not consumed at the last deal
        self._rank, self._size = 0, 1
        self._done = 0  # samples this rank consumed since the last deal (record_batch)
        self._epoch_seen = -1  # membership epoch of the last deal
        self._deals = 0  # how many deals so far (an iterator notices a new one)
        self._last_batch = 0  # the last record_batch's size
        self._gone: List[int] = []  # rendezvous ranks known to have left at the last deal
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch``: its whole order, dealt over the workers in the job now."""
        self.epoch = int(epoch)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._remaining = torch.randperm(self.num_samples_total, generator=g).tolist()
        else:
            self._remaining = list(range(self.num_samples_total))
        self._deal()

    def record_batch(self, batch_size: int) -> None:
        """Marks this rank's next ``batch_size`` samples as consumed (call after each step)."""
        self._last_batch = int(batch_size)
        self._done = min(self._done + self._last_batch, self._share_len())
        self._follow_membership()  # a step boundary: where a new deal starts

    @staticmethod
    def _membership() -> dict:
        if not engine.is_initialized():
            return {"answered_epoch": 0, "answered_departed": [], "rendezvous_rank": 0, "rendezvous_size": 1}
        return engine.membership()

    def _deal(self, m=None) -> None:
        """Deals ``_remaining`` over the workers of the answered membership ``m``."""
        m = m or self._membership()
        gone = sorted(m["answered_departed"])
        me = m["rendezvous_rank"]
        self._rank = me - sum(1 for r in gone if r < me)
        self._size = m["rendezvous_size"] - len(gone)
        self._epoch_seen, self._gone = m["answered_epoch"], gone
        self._done = self._last_batch = 0
        self._deals += 1

    def _share_len(self) -> int:
        return math.ceil(len(self._remaining) / self._size) if self._remaining else 0

    def _share(self, rank: int) -> List[int]:
        """``rank``'s share of the remaining samples: every size-th, padded by wrapping."""
        n = self._share_len()
        padded = self._remaining + self._remaining[: n * self._size - len(self._remaining)]
        return padded[rank::self._size]

    def _drop_consumed(self, departed=()) -> None:
        """Removes what every rank of the last deal consumed: ``_done`` samples each
        (lockstep), but a rank in ``departed`` (positions in the last deal) one batch
        less, as its last batch may not have counted (at least once, never dropped)."""
        consumed = set()
        for rank in range(self._size):
            done = max(0, self._done - self._last_batch) if rank in departed else self._done
            consumed.update(self._share(rank)[:done])
        self._remaining = [i for i in self._remaining if i not in consumed]

    def _follow_membership(self) -> None:
        """After workers left: deal what nobody consumed yet over the workers that remain."""
        m = self._membership()
        if m["answered_epoch"] == self._epoch_seen:
            return
        # The last deal's ranks, by their rendezvous ranks (ranks keep their order).
        before = [r for r in range(m["rendezvous_size"]) if r not in self._gone]
        left = {before.index(r) for r in m["answered_departed"] if r not in self._gone}
        self._drop_consumed(left)
        self._deal(m)

    def __iter__(self) -> Iterator[int]:
        self._follow_membership()
        deal, pos = self._deals, self._done
        while True:
            # Deals happen at step boundaries (record_batch), never between two samples
            # of one batch: a batch is all from one share.
            if self._deals != deal:  # dealt again mid-epoch: go on from the new share's start
                deal, pos = self._deals, self._done
            share = self._share(self._rank)
            if pos >= len(share):
                return
            yield share[pos]
            pos += 1

    @property
    def deals(self) -> int:
        """How many times the samples were dealt (each epoch, and after workers left)."""
        return self._deals

    def __len__(self) -> int:
        return max(0, self._share_len() - self._done)

    def state_dict(self) -> dict:
        """Where the epoch is: resume with :meth:`load_state_dict` (same dataset)."""
        return {"epoch": self.epoch, "remaining": list(self._remaining), "done": self._done,
                "size": self._size}

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`: what was consumed then is left out, the rest dealt
        over the workers in the job now."""
        self.epoch = int(state["epoch"])
        self._remaining, self._size, self._done = list(state["remaining"]), int(state["size"]), int(state["done"])
        self._drop_consumed()
        self._deal()


class TorchState:
    """What a worker that joins the running job needs, and the step where it joins
    (``comm.fault_tolerance``): Horovod's ``hvd.elastic.TorchState``, without rollbacks.

        state = bps.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)
        state.sync()                   # at the start: every rank gets rank 0's values
        while state.step < steps:
            ...one training step...
            state.step += 1
            state.commit()             # a step boundary: waiting workers join here

    A worker that dies leaves the job and the others go on (nothing to roll back: the
    servers hold no model in synchronous training). A worker process started later (the
    launcher's ``--max-restarts``, or a hand-started one in a free place) waits in
    ``init()`` until the others' next :meth:`commit`, then runs the same script: its
    ``state.sync()`` meets the :meth:`sync` the others run inside that commit, so it
    starts from their parameters, optimizer state, sampler position and extras
    (``epoch``, ``step`` ...), and its gradients count from the next step.

    Args:
        model: its ``state_dict()`` (parameters and buffers) is sent to joiners.
        optimizer: its state and options are sent to joiners (None: no optimizer).
        sampler: an :class:`ElasticSampler`, whose unconsumed samples are dealt again
            over the workers including the joiners.
        **extras: plain values (epoch, step, best loss ...) kept as attributes.
    """

    def __init__(self, model=None, optimizer=None, sampler: "ElasticSampler" = None, **extras):
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self._extras = list(extras)
        for key, value in extras.items():
            setattr(self, key, value)
        self.syncs = 0  # how many times the state was sent (at the start, then per join)

    def commit(self) -> list:
        """A step boundary (call it on every rank at the same step): admits the workers
        waiting to join, then sends them the state. Returns the ranks that joined."""
        joined = engine.admit()
        if joined:
            # The workers in the job hold the root's model and optimizer already: only
            # the joiners download them.
            self._sync(engine.to_joiners())
        return joined

    def sync(self) -> None:
        """Makes every rank's state the root's: the lowest rank that was in the job
        before the newest join (rank 0 at the start)."""
        self._sync(contextlib.nullcontext())

    def _sync(self, tensors_scope) -> None:
        from bpstrain.torch import functions

        root = self._root()
        with tensors_scope:
            if self.model is not None:
                functions.broadcast_parameters(self.model.state_dict(), root, prefix="elastic.model")
            if self.optimizer is not None:
                functions.broadcast_optimizer_state(self.optimizer, root, prefix="elastic.optimizer")
        extras = {key: getattr(self, key) for key in self._extras}
        sampler = self.sampler.state_dict() if self.sampler is not None else None
        extras, sampler = functions.broadcast_object((extras, sampler), root, name="elastic.state")
        for key, value in extras.items():
            setattr(self, key, value)
        if self.sampler is not None:
            # On every rank, the root included: the unconsumed samples are dealt over the
            # workers in the job now at this same step.
            self.sampler.load_state_dict(sampler)
        self.syncs += 1

    @staticmethod
    def _root() -> int:
        """The root, as a rank among the workers in the job (what rank() numbers)."""
        return engine.sync_root() if engine.is_initialized() else 0
