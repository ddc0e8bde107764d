"""CrossBarrier: the next forward pass starts before every gradient is back.

    optimizer = bps.CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), num_steps=steps)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()            # returns at once: nothing is waited for here
    optimizer.synchronize()         # every update applied (state_dict() does this too)

With :func:`~bpstrain.torch.DistributedOptimizer`, ``step()`` is a barrier: it waits for
every gradient, then updates every parameter. Here ``step()`` only records what is in
flight, and each module's forward pre-hook waits for *its own* parameters' push_pulls
and applies the wrapped optimizer's update to exactly those parameters before the
module runs. Front layers have the highest priority, so their averages are back first
and the next forward pass overlaps the communication of the back layers (BytePS's
``byteps.torch.cross_barrier``, after the ByteScheduler paper).

The arithmetic is DistributedOptimizer's: every parameter gets one update per step,
from the rank-averaged gradient, by the wrapped optimizer (any ``torch.optim``
optimizer that needs no closure), only later. Requirements:

* a parameter is used only inside a module of ``model`` that owns it (tied weights
  are fine: every owner waits); a parameter used elsewhere while its update is still
  pending makes the next backward raise ``RuntimeError`` instead of corrupting it;
* evaluation and checkpoints see the updated values: an ``eval`` forward goes through
  the same hooks, and ``state_dict()`` / ``synchronize()`` apply whatever is pending.
* ``zero_grad()`` is deferred for parameters whose update is pending (their gradient
  still carries the average), and applied right after the update.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from bpstrain.torch import ops
from bpstrain.torch.compression import Compression
from bpstrain.torch.optimizer import _DistributedOptimizer, _wrap

_MAX_BATCH = 64  # parameters one optimizer call may update at a forward pre-hook


def _zero_one(p: torch.Tensor, set_to_none: bool) -> None:
    """``Optimizer.zero_grad`` for one parameter."""
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
        return
    if p.grad.grad_fn is not None:
        p.grad.detach_()
    else:
        p.grad.requires_grad_(False)
    p.grad.zero_()


class _CrossBarrier(_DistributedOptimizer):
    """Methods mixed into the dynamic optimizer subclass, over DistributedOptimizer's."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 fusion_threshold_bytes, model, num_steps):
        _DistributedOptimizer.__init__(self, params, named_parameters, compression,
                                       backward_passes_per_step, fusion_threshold_bytes)
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1. Received: num_steps={num_steps}")
        self._cb_num_steps = int(num_steps)
        self._cb_steps = 0
        # id(p) -> p, in parameter (forward) order: updates not applied yet
        self._cb_pending: Dict[int, torch.Tensor] = {}
        # id(p) -> (handle, compression ctx, had_grad) or (bucket, None, had_grad)
        self._cb_ops: Dict[int, tuple] = {}
        self._cb_zero: Dict[int, bool] = {}  # deferred zero_grad(set_to_none) per parameter
        self._cb_buckets: set = set()  # buckets whose push_pull belongs to a pending step
        self._cb_owned = set()
        self._cb_hooks = []
        for module in model.modules():
            own = list(module.parameters(recurse=False))
            if own:
                self._cb_owned.update(id(p) for p in own)
                self._cb_hooks.append(module.register_forward_pre_hook(self._cb_before_forward))

    # -- the step ---------------------------------------------------------------------

    def step(self, closure=None):
        """Records this step's push_pulls; updates happen at each module's next forward."""
        if closure is not None:
            raise ValueError("CrossBarrier.step() takes no closure: updates are applied "
                             "layer by layer at the next forward pass. Received: a closure")
        if not self._bps_active or self._bps_synchronized or not self._bps_should_synchronize:
            # Gradients already averaged (explicit synchronize()) or nothing to average.
            self._cb_flush()
            self._bps_synchronized = False
            return super(self.__class__, self).step()
        self._cb_flush()  # parameters the last forward did not use
        self._bps_launch_missing()
        had = dict(self._bps_had_grad)
        deferred = []
        for p in self._bps_params():
            key = id(p)
            if key in self._bps_handles:
                _, handle, ctx = self._bps_handles[key]
                self._cb_ops[key] = (handle, ctx, had)
            elif key in self._bps_bucket_of and self._bps_bucket_of[key].handle is not None \
                    and p.requires_grad:
                bucket = self._bps_bucket_of[key]
                self._cb_ops[key] = (bucket, None, had)
                self._cb_buckets.add(bucket)
            else:
                continue
            self._cb_pending[key] = p
            if key not in self._cb_owned:
                deferred.append(p)
        self._bps_handles.clear()
        self._bps_end_step(reset_buckets=False)
        self._cb_steps += 1
        if self._cb_steps >= self._cb_num_steps:
            self._cb_flush()  # the last step is a barrier again
        elif deferred:
            self._cb_apply(deferred)  # no module will ask for these
        others = [p for p in self._bps_params()
                  if id(p) not in self._cb_pending and p.grad is not None]
        if others:  # not distributed (added later, ...): updated now, as DistributedOptimizer would
            self._cb_update(others)
        return None

    def synchronize(self):
        """Applies every pending update (a barrier).

        Called between ``backward()`` and ``step()`` it also averages this step's
        gradients now, as DistributedOptimizer's does (gradient clipping), and that
        ``step()`` then updates every parameter at once.
        """
        self._cb_flush()
        if self.in_flight():
            _DistributedOptimizer.synchronize(self)

    def state_dict(self, server_state: bool = False):
        """The wrapped optimizer's state (and the compressors') after every pending update
        (``server_state``: see DistributedOptimizer's)."""
        self._cb_flush()
        return _DistributedOptimizer.state_dict(self, server_state)

    def zero_grad(self, set_to_none: bool = True):
        """Zeroes now, or right after the update for parameters whose update is pending."""
        if self.in_flight():
            _DistributedOptimizer.zero_grad(self, set_to_none)  # raises the usual error
        for p in self._bps_params():
            if id(p) in self._cb_pending:
                self._cb_zero[id(p)] = set_to_none
            else:
                _zero_one(p, set_to_none)

    def in_flight(self) -> int:
        """push_pulls of the current step (started by hooks, not yet handed to step())."""
        return len(self._bps_handles) + sum(b.handle is not None and b not in self._cb_buckets
                                            for b in self._bps_buckets)

    def pending_updates(self) -> int:
        """Parameters whose averaged update has not been applied yet."""
        return len(self._cb_pending)

    # -- applying updates -------------------------------------------------------------

    def _bps_ready(self, p):
        if id(p) in self._cb_pending:
            raise RuntimeError(
                "CrossBarrier: a gradient arrived for a parameter whose previous update is "
                "still pending, so it was used outside the forward of the module that owns "
                "it. Use it through its module, or call optimizer.synchronize() before that "
                f"forward pass. Received: parameter {self._bps_names.get(id(p), '?')}")
        _DistributedOptimizer._bps_ready(self, p)

    def _cb_before_forward(self, module, args):
        mine = [p for p in module.parameters(recurse=False) if id(p) in self._cb_pending]
        if not mine:
            return
        batch, ids = list(mine), {id(p) for p in mine}
        # Take along the pending parameters that follow in forward order and are back
        # already: a network of many small layers then pays fewer optimizer calls.
        # Only those after this module's: earlier ones belong to modules that already ran.
        seen = False
        for key, p in self._cb_pending.items():
            if key in ids:
                seen = True
                continue
            if not seen:
                continue
            if len(batch) >= _MAX_BATCH or not self._cb_done(key):
                break
            batch.append(p)
        self._cb_apply(batch)

    def _cb_done(self, key: int) -> bool:
        op, ctx, _ = self._cb_ops[key]
        if ctx is None:  # a bucket
            return op.handle is None or ops.poll(op.handle)
        return ops.poll(op)

    def _cb_flush(self) -> None:
        if self._cb_pending:
            self._cb_apply(list(self._cb_pending.values()))

    def _cb_apply(self, params: List[torch.Tensor]) -> None:
        """Waits for ``params``' averages, updates exactly them, runs deferred zero_grads."""
        for p in params:
            op, ctx, had = self._cb_ops[id(p)]
            if ctx is None:
                if op.handle is not None:  # the first member to need it finishes the bucket
                    op.finish(self._bps_compression, had)
                    self._cb_buckets.discard(op)
            else:
                self._bps_finish_param(p, op, ctx, had)
        self._cb_update(params)
        for p in params:
            key = id(p)
            del self._cb_pending[key], self._cb_ops[key]
            if key in self._cb_zero:
                _zero_one(p, self._cb_zero.pop(key))

    def _cb_update(self, params: List[torch.Tensor]) -> None:
        """One step of the wrapped optimizer restricted to ``params`` (state is per parameter)."""
        ids = {id(p) for p in params}
        groups = self.param_groups
        subset = [{**g, "params": [p for p in g["params"] if id(p) in ids]} for g in groups]
        self.param_groups = [g for g in subset if g["params"]]
        try:
            super(self.__class__, self).step()
        finally:
            self.param_groups = groups


def CrossBarrier(model, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step=1, num_steps=10**6, fusion_threshold_bytes=1 << 20):
    """A DistributedOptimizer whose ``step()`` does not wait (see the module docstring).

    Args:
        model: the ``torch.nn.Module`` being trained (its modules get forward pre-hooks).
        optimizer: a plain ``torch.optim`` optimizer over ``model``'s parameters.
        named_parameters, compression, backward_passes_per_step, fusion_threshold_bytes:
            as for :func:`~bpstrain.torch.DistributedOptimizer`.
        num_steps: training steps in all; the last ``step()`` waits for every update
            (BytePS's argument). Otherwise call ``synchronize()`` when training ends.

    Raises:
        ValueError: as DistributedOptimizer, or ``optimizer`` is already wrapped.
    """
    methods = {**_DistributedOptimizer.__dict__, **_CrossBarrier.__dict__}
    return _wrap(optimizer, methods, named_parameters, compression, backward_passes_per_step,
                 fusion_threshold_bytes, model, num_steps)


# ``import bpstrain.torch.cross_barrier as bps`` works like BytePS's module of that name:
# the rest of the adapter is reachable from here too.
from bpstrain.torch.functions import (broadcast_object, broadcast_optimizer_state,  # noqa: E402
                                      broadcast_parameters)
from bpstrain.torch.ops import (init, local_rank, local_size, push_pull, push_pull_async,  # noqa: E402
                                push_pull_inplace, rank, shutdown, size, synchronize)
from bpstrain.torch.optimizer import DistributedOptimizer  # noqa: E402,F401
