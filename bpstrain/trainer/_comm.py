"""What the torch training loop needs from the engine, in one small object.

Gradients go through :mod:`bpstrain.torch` (``DistributedOptimizer``,
``broadcast_parameters``, ``broadcast_optimizer_state``) when that adapter is
installed; otherwise a minimal engine-based fallback averages gradients before
``step()``. Metrics are reduced with :func:`bpstrain.engine.push_pull`.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, Optional

import numpy as np

from bpstrain import engine


def _torch_adapter():
    """``bpstrain.torch`` or None when it is not available in this installation."""
    try:
        import bpstrain.torch as bps_torch
    except ImportError as err:
        if getattr(err, "name", None) not in ("bpstrain.torch",):
            raise  # the adapter exists but is broken: say so rather than hide it
        return None
    needed = ("DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state")
    return bps_torch if all(hasattr(bps_torch, n) for n in needed) else None


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
        self.adapter = _torch_adapter() if self.size > 1 else None
        if self.adapter is not None:
            self.adapter.init()  # the engine is up already; this sets up the torch layer

    @property
    def distributed(self) -> bool:
        """True when more than one rank takes part."""
        return self.size > 1

    def wrap_optimizer(self, optimizer, module, backward_passes_per_step: int = 1):
        """The optimizer whose ``step()`` applies gradients averaged over all ranks."""
        if not self.distributed:
            return optimizer
        if self.adapter is not None:
            return self.adapter.DistributedOptimizer(
                optimizer, named_parameters=module.named_parameters(),
                backward_passes_per_step=backward_passes_per_step)
        return _AveragingOptimizer(optimizer, module)

    @staticmethod
    def unwrap_optimizer(optimizer):
        """The user's torch optimizer behind a fallback wrapper (for state_dict)."""
        return getattr(optimizer, "inner", optimizer)

    def broadcast_state(self, module, optimizer) -> None:
        """Makes every rank start from rank 0's parameters and optimizer state."""
        if not self.distributed:
            return
        if self.adapter is not None:
            self.adapter.broadcast_parameters(module.state_dict(), root_rank=0)
            self.adapter.broadcast_optimizer_state(self.unwrap_optimizer(optimizer), root_rank=0)
            return
        for name, tensor in module.state_dict().items():
            _broadcast_tensor(tensor, f"trainer.bcast.{name}")

    def broadcast_object(self, obj: Any, name: str) -> Any:
        """Rank 0's picklable ``obj`` on every rank (others pass anything, e.g. None)."""
        if not self.distributed:
            return obj
        if self.adapter is not None and hasattr(self.adapter, "broadcast_object"):
            return self.adapter.broadcast_object(obj, root_rank=0, name=name)
        import pickle

        payload = np.frombuffer(pickle.dumps(obj), np.uint8).copy() if self.rank == 0 else None
        length = np.array([0 if payload is None else payload.size], np.int64)
        engine.broadcast(length, 0, f"{name}.length", out=length)
        if payload is None:
            payload = np.empty(int(length[0]), np.uint8)
        # A name keeps the shape of its first use: one name per payload size.
        engine.broadcast(payload, 0, f"{name}.payload.{payload.size}", out=payload)
        return obj if self.rank == 0 else pickle.loads(payload.tobytes())

    def sum(self, values: np.ndarray, name: str) -> np.ndarray:
        """Element-wise sum of a float64 vector over all ranks (same length everywhere)."""
        values = np.ascontiguousarray(values, dtype=np.float64)
        if not self.distributed:
            return values.copy()
        return engine.push_pull(values, name=name, average=False)

    def sum_metrics(self, sums: Dict[str, float], tag: str) -> Dict[str, float]:
        """Sums a ``{name: value}`` dict over ranks; every rank must pass the same keys."""
        keys = sorted(sums)
        # The name encodes the key set: a tensor name must keep one shape forever.
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
            (self.adapter.shutdown if self.adapter is not None else engine.shutdown)()


def _as_numpy(tensor):
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.detach().cpu().view(torch.int16).numpy(), "bfloat16"
    return tensor.detach().cpu().numpy(), None


def _broadcast_tensor(tensor, name: str) -> None:
    import torch

    array, dtype = _as_numpy(tensor.contiguous())
    result = engine.broadcast(array, root_rank=0, name=name, dtype=dtype)
    with torch.no_grad():
        src = torch.from_numpy(result)
        tensor.copy_(src.view(torch.bfloat16) if dtype == "bfloat16" else src)


class _AveragingOptimizer:
    """Fallback when ``bpstrain.torch`` is missing: average gradients, then step.

    Every gradient is started asynchronously (front layers first), then all are
    awaited; attribute access is forwarded to the wrapped optimizer.
    """

    def __init__(self, optimizer, module):
        self.inner = optimizer
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, closure=None):
        import torch

        pending = []
        for index, (name, param) in enumerate(self._named):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad.detach().contiguous()
            array, dtype = _as_numpy(grad)
            handle = engine.push_pull_async(array, name=f"grad.{name}", average=True,
                                            priority=-index, dtype=dtype)
            pending.append((param, handle, dtype))
        for param, handle, dtype in pending:
            out = torch.from_numpy(engine.synchronize(handle))
            param.grad.copy_(out.view(torch.bfloat16) if dtype == "bfloat16" else out)
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True):
        return self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        return self.inner.load_state_dict(state)
