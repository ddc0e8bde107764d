"""What the training loop needs from the engine, in one small object.

Gradients and model state go through :mod:`bpstrain.torch` (``DistributedOptimizer``,
``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object``), imported
only when a torch model trains on several ranks; metrics are reduced with
:func:`bpstrain.engine.push_pull` (Keras models use nothing else).
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, Optional

import numpy as np

from bpstrain import engine


class Comm:
    """Rank/size, gradient averaging, broadcasts and metric reduction for one process.

    Args:
        comm_options: The ``comm`` config section as a plain dict.
    """

    def __init__(self, comm_options: Optional[Dict[str, Any]] = None):
        self.started_engine = not engine.is_initialized()
        engine.init(comm_options or None)
        self.rank, self.size = engine.rank(), engine.size()
        self.local_rank, self.local_size = engine.local_rank(), engine.local_size()
        self._torch = None

    def on_membership_change(self, callback) -> None:
        """comm.fault_tolerance: after workers left, renumbers this rank over the workers
        that remain, then calls ``callback(engine.membership())``."""
        def follow(membership: dict) -> None:
            self.rank, self.size = membership["rank"], membership["size"]
            callback(membership)

        engine.on_membership_change(follow)

    @property
    def distributed(self) -> bool:
        """True when more than one rank takes part."""
        return self.size > 1

    @property
    def admitted_late(self) -> bool:
        """comm.fault_tolerance: this worker joined the job while it ran (a restarted or
        added worker): it takes the others' state where they are, not rank 0's start."""
        return bool(engine.membership()["admitted_late"])

    def _adapter(self):
        """``bpstrain.torch``, set up on the running engine at first use."""
        if self._torch is None:
            import bpstrain.torch as bps_torch

            bps_torch.init()  # the engine is up already; this sets up the torch layer
            self._torch = bps_torch
        return self._torch

    def compression_policy(self):
        """The ``comm.compression*`` keys in force (config over environment) as a
        :class:`bpstrain._compression.CompressionPolicy`; None when nothing is compressed."""
        options = engine.options()
        spec = options.get("compression") or "none"
        rules = list(options.get("compression_rules") or ())
        if spec == "none" and not rules:
            return None
        from bpstrain._compression import parse_policy

        return parse_policy(spec, rules, int(options.get("compression_min_size", 1024)))

    def wrap_optimizer(self, optimizer, module, backward_passes_per_step: int = 1):
        """The optimizer whose ``step()`` applies gradients averaged over all ranks
        (compressed as ``comm.compression`` says; its state_dict carries the
        error-feedback state, so the Trainer's checkpoints do)."""
        if not self.distributed:
            return optimizer
        extra = {}
        policy = self.compression_policy()
        if policy is not None:
            extra["compression"] = policy
        return self._adapter().DistributedOptimizer(
            optimizer, named_parameters=module.named_parameters(),
            backward_passes_per_step=backward_passes_per_step, **extra)

    def broadcast_state(self, module, optimizers=None) -> None:
        """Makes every rank start from rank 0's parameters and optimizers' state.

        Args:
            optimizers: None, an optimizer or a list of them.
        """
        if not self.distributed:
            return
        self._adapter().broadcast_parameters(module.state_dict(), root_rank=0)
        if optimizers is None:
            optimizers = []
        elif not isinstance(optimizers, (list, tuple)):
            optimizers = [optimizers]
        for i, optimizer in enumerate(optimizers):
            prefix = "broadcast_optimizer_state" + (f".{i}" if i else "")
            self._adapter().broadcast_optimizer_state(optimizer, root_rank=0, prefix=prefix)

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        """Rank ``root``'s picklable ``obj`` on every rank (others pass anything, e.g. None)."""
        if not self.distributed:
            return obj
        return self._adapter().broadcast_object(obj, root_rank=root, name=name)

    def gather_object(self, obj: Any, name: str) -> list:
        """Every rank's picklable ``obj``, in rank order, on every rank (collective)."""
        if not self.distributed:
            return [obj]
        return [self._adapter().broadcast_object(obj if r == self.rank else None, root_rank=r,
                                                 name=f"{name}.{r}") for r in range(self.size)]

    def sum(self, values: np.ndarray, name: str) -> np.ndarray:
        """Element-wise sum of a float64 vector over all ranks (same length everywhere)."""
        values = np.ascontiguousarray(values, dtype=np.float64)
        if not self.distributed:
            return values.copy()
        return engine.push_pull(values, name=name, average=False)

    def sum_metrics(self, sums: Dict[str, float], tag: str) -> Dict[str, float]:
        """Sums a ``{name: value}`` dict over ranks; every rank must pass the same keys."""
        keys = sorted(sums)
        # One name per key set: the key set may grow (validation metrics from the second
        # epoch on), and the engine's shared-memory path (workers of one host) cannot
        # declare a name again with another size yet, as the flat path can.
        digest = hashlib.sha1("|".join(keys).encode()).hexdigest()[:10]
        total = self.sum(np.array([sums[k] for k in keys], np.float64), f"trainer.{tag}.{digest}")
        return dict(zip(keys, total.tolist()))

    def barrier(self) -> None:
        """Waits for every rank."""
        if self.distributed:
            engine.barrier()

    def close(self, leave_engine: bool) -> None:
        """Shuts the engine down if this object started it and ``leave_engine`` is False."""
        if self.started_engine and not leave_engine:
            (self._torch.shutdown if self._torch is not None else engine.shutdown)()
