"""Embedding layers whose table the parameter servers keep (sparse training's storage mode).

    emb = bps.ServerEmbeddingBag(40_000_000, 64, name="user_emb", mode="sum",
                                 optimizer="adagrad", lr=0.05)
    out = emb(ids, offsets)        # pulls this batch's rows from the servers
    loss.backward()                # pushes their gradients; the servers apply the optimizer

The table is not a ``Parameter``: the local optimizer and ``DistributedOptimizer`` never
see it, and a worker holds only the rows of its current batch. ``forward`` pulls the
batch's unique rows (waiting first for the previous step's push, so it reads the updated
rows); ``backward`` starts the push of their gradients, which overlaps the rest of the
backward pass and the dense optimizer step. Both are collective, like the dense
push_pulls: every rank calls the layer the same number of times (evaluation included).

Pipelined, as TorchRec's training pipeline: after a step's forward, ``emb.prefetch(next_ids)``
starts pulling the next batch's rows as soon as this step's push is on its way, so they
travel while the gradients do; the next forward with those ids takes them (the rows the
push changed come with the push's answer) — the same rows as without the prefetch::

    out = emb(ids, offsets)
    emb.prefetch(next_ids)         # collective, like forward
    loss.backward()
"""

from __future__ import annotations

import math
import warnings
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from bpstrain.embedding_table import EmbeddingTable, Prefetch


class _ServerTableLayer(torch.nn.Module):
    """The pull/push plumbing shared by :class:`ServerEmbedding` and :class:`ServerEmbeddingBag`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, name: str, optimizer: str, lr: float,
                 init_scale: Optional[float], seed: int, eps: Optional[float], initial_accumulator_value: float,
                 betas: Tuple[float, float]):
        super().__init__()
        if lr < 0:
            raise ValueError(f"lr must be >= 0. Received: {lr}")
        if init_scale is None:  # DLRM's initialiser: uniform in +-sqrt(1/num_embeddings)
            init_scale = math.sqrt(1.0 / num_embeddings)
        self.table = EmbeddingTable(name, num_embeddings, embedding_dim, optimizer=optimizer,
                                    init_scale=init_scale, seed=seed, eps=eps,
                                    initial_accumulator=initial_accumulator_value, betas=betas)
        self.num_embeddings, self.embedding_dim, self.lr = num_embeddings, embedding_dim, float(lr)
        self._pushing: Optional[List[int]] = None  # the last backward's push, until waited for
        self._ahead: Optional[Prefetch] = None  # the next forward's rows, on their way
        self._prefetch_at_push: Optional[np.ndarray] = None  # ids to prefetch once the push starts
        self._push_due = False  # a training forward whose backward has not pushed yet
        self._warned_unsaved = False
        self._register_state_dict_hook(_TableNotSaved())

    def prefetch(self, input: torch.Tensor) -> None:
        """Starts pulling the rows of the next forward's ``input`` (collective). Called
        after this step's forward, the pull starts once this step's push does (at once if
        it has); the next forward takes the rows if its ids are the same (any order and
        duplicates), otherwise it pulls as usual."""
        unique = self.table.check_ids(torch.unique(self._ids(input).detach().cpu(), sorted=True).numpy())
        if self._ahead is not None:
            self.table.discard(self._ahead)
            self._ahead = None
        if self._push_due:
            self._prefetch_at_push = unique
        else:
            self._ahead = self.table.prefetch(unique)

    def synchronize(self) -> None:
        """Waits for the last backward's push (the next ``forward`` does it by itself)."""
        pushing, self._pushing = self._pushing, None
        self.table.wait(pushing or [])

    def _ids(self, input: torch.Tensor) -> torch.Tensor:
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{type(self).__name__} expects integer ids. Received: {input.dtype}")
        return input

    def _rows(self, input: torch.Tensor):
        """``(inverse, rows)``: ``input`` renumbered into the pulled unique rows."""
        unique, inverse = torch.unique(self._ids(input).detach().cpu(), sorted=True, return_inverse=True)
        unique_np = self.table.check_ids(unique.numpy())
        will_push = torch.is_grad_enabled() and self.training
        ahead = self._ahead
        self.synchronize()
        if ahead is not None and np.array_equal(ahead.unique, unique_np):
            self._ahead = None
            got = self.table.take(ahead)
        else:
            # A forward that does not push (evaluation) leaves the prefetch for the next
            # one; a training forward's push would change its rows.
            if ahead is not None and will_push:
                self._ahead = None
                self.table.discard(ahead)
            got = self.table.pull_unique(unique_np)
        rows = torch.from_numpy(got).to(input.device)
        if will_push:
            self._push_due, self._prefetch_at_push = True, None
            rows.requires_grad_(True)
            rows.register_hook(lambda grad: self._push(unique_np, grad))
        return inverse.to(input.device).view_as(input), rows

    def _push(self, unique: np.ndarray, grad: torch.Tensor) -> None:
        if self._pushing is not None:
            raise RuntimeError(f"{type(self).__name__} {self.table.name!r}: a second backward before the next "
                               "forward; each forward's rows are pushed once (call forward again first)")
        self._pushing = self.table.push_async(unique, grad.detach().cpu().float().numpy(), self.lr)
        self._push_due = False
        if self._prefetch_at_push is not None:  # now the rows travel while the gradients do
            self._ahead = self.table.prefetch(self._prefetch_at_push)
            self._prefetch_at_push = None

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, name={self.table.name!r}, "
                f"optimizer={self.table.optimizer}, lr={self.lr}")


class _TableNotSaved:
    """A state_dict hook: warns, once per layer, that a checkpoint of the model does not
    hold the servers' table, so that nobody learns it only after a resume has quietly
    restarted the rows from their initialiser."""

    def __call__(self, module, state_dict, prefix, local_metadata):
        if not module._warned_unsaved:
            module._warned_unsaved = True
            warnings.warn(f"{type(module).__name__} {module.table.name!r}: the table's rows (kept by the "
                          "servers, or by this process without them) are not saved in the model's "
                          "state_dict; a checkpoint restores the rest of the model, and a resumed job "
                          "starts this table from its initialiser", UserWarning, stacklevel=3)
        return None


class ServerEmbedding(_ServerTableLayer):
    """``torch.nn.Embedding`` whose table lives on the parameter servers.

    Args:
        num_embeddings, embedding_dim: the table's shape.
        name: the table's name, the same on every rank (one per layer).
        optimizer: ``"sgd"``, ``"adagrad"`` or ``"adam"`` (``torch.optim.SparseAdam``'s
            rule), applied on the servers with ``lr`` (an attribute: change it between
            steps for a schedule).
        init_scale: rows start uniform in ``[-init_scale, init_scale)`` (default
            ``sqrt(1 / num_embeddings)``, DLRM's); 0 starts them at zeros.
        seed: the initialiser's seed.
        eps: Adagrad's or Adam's (torch's defaults, 1e-10 and 1e-8).
        initial_accumulator_value: Adagrad's.
        betas: Adam's.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, name: str, optimizer: str = "sgd",
                 lr: float = 0.01, init_scale: Optional[float] = None, seed: int = 0, eps: Optional[float] = None,
                 initial_accumulator_value: float = 0.0, betas: Tuple[float, float] = (0.9, 0.999)):
        super().__init__(num_embeddings, embedding_dim, name, optimizer, lr, init_scale, seed, eps,
                         initial_accumulator_value, betas)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        inverse, rows = self._rows(input)
        return F.embedding(inverse, rows)


class ServerEmbeddingBag(_ServerTableLayer):
    """``torch.nn.EmbeddingBag`` (``mode`` sum, mean or max; ``offsets`` and
    ``per_sample_weights`` as there) whose table lives on the parameter servers; the
    other arguments as :class:`ServerEmbedding`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, name: str, mode: str = "mean",
                 optimizer: str = "sgd", lr: float = 0.01, init_scale: Optional[float] = None, seed: int = 0,
                 eps: Optional[float] = None, initial_accumulator_value: float = 0.0,
                 betas: Tuple[float, float] = (0.9, 0.999)):
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max'. Received: {mode!r}")
        super().__init__(num_embeddings, embedding_dim, name, optimizer, lr, init_scale, seed, eps,
                         initial_accumulator_value, betas)
        self.mode = mode

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        inverse, rows = self._rows(input)
        return F.embedding_bag(inverse, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights)
