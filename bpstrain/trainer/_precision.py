"""``trainer.precision`` and ``trainer.gradient_clip_val``: autocast, loss scaling, clipping.

* ``"32"``: plain float32.
* ``"bf16"``: forward passes under ``torch.autocast(dtype=torch.bfloat16)``; no scaler
  (bfloat16 has float32's range).
* ``"16"``: forward passes under ``torch.autocast(dtype=torch.float16)`` and a
  ``torch.amp.GradScaler``: the loss is scaled before backward, gradients are unscaled
  after they were averaged over ranks, and a step whose gradients hold inf/NaN is
  skipped while the scale shrinks. The averaged gradients are the same on every rank,
  so every rank skips the same steps. Meant for CUDA; on CPU it works as well (torch
  has float16 CPU kernels) but is slower than ``"bf16"``.

One optimizer step, in Lightning's order (see :func:`optimizer_step`)::

    synchronize (average gradients)  ->  unscale  ->  on_before_optimizer_step
    ->  clip  ->  step (skipped on inf with "16")  ->  scaler.update
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional

import torch

_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


class Precision:
    """Autocast and loss scaling for one device.

    Args:
        precision: ``trainer.precision`` ("32", "bf16" or "16").
        device: The device the module trains on.
    """

    def __init__(self, precision: str, device: torch.device):
        if precision not in ("32", *_DTYPES):
            raise ValueError("precision must be '32', 'bf16' or '16'. "
                             f"Received: precision={precision!r}")
        self.precision, self.device = precision, device
        self.scaler: Optional[torch.amp.GradScaler] = (
            torch.amp.GradScaler(device.type) if precision == "16" else None)

    def autocast(self):
        """Context manager for forward passes (a no-op at "32")."""
        if self.precision == "32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=_DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled first with "16"."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer) -> None:
        """Divides the gradients by the loss scale (call after they were averaged)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer, update: bool = True) -> None:
        """Steps the optimizer; with "16" the scaler skips a step with inf/NaN gradients.

        Args:
            update: Update the loss scale afterwards; with several optimizers pass False
                and call :meth:`update` once after stepping them all.

        Nothing here reads the scale back: that would wait for the GPU every step.
        """
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        if update:
            self.scaler.update()

    def update(self) -> None:
        """Updates the loss scale (after every optimizer of the step has stepped)."""
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> Dict[str, Any]:
        """The scaler's state (empty without one), saved in checkpoints."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def clip_gradients(optimizers, value: Optional[float], algorithm: str):
    """Clips every parameter's gradient; returns the total norm before clipping ("norm"),
    as a 0-d tensor (reading it as a number would wait for the GPU).

    Args:
        optimizers: An optimizer or a list of them; the norm is over all their
            parameters together (as if they were one optimizer).
        value: ``trainer.gradient_clip_val``; None = no clipping.
        algorithm: ``"norm"`` (total 2-norm over all gradients) or ``"value"`` (each
            element into [-value, value]).
    """
    if value is None:
        return None
    if not isinstance(optimizers, (list, tuple)):
        optimizers = [optimizers]
    params = [p for optimizer in optimizers for group in optimizer.param_groups
              for p in group["params"] if p.grad is not None]
    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(params, value)
        return None
    return torch.nn.utils.clip_grad_norm_(params, value)


def optimizer_step(trainer, module, precision: Precision, fire) -> None:
    """One optimizer step after the backward passes of a step (see the module docstring).

    Gradients are averaged first (``synchronize``), so the hook, clipping and the inf
    check all see the same averaged gradients on every rank. With several optimizers
    (``trainer.optimizers``) each is synchronized, unscaled and announced to
    ``on_before_optimizer_step``; clipping then sees all their gradients together,
    each steps, and the loss scale is updated once.
    """
    optimizers = list(getattr(trainer, "optimizers", None) or [trainer.optimizer])
    for optimizer in optimizers:
        if hasattr(optimizer, "skip_synchronize"):
            optimizer.synchronize()
    for optimizer in optimizers:
        precision.unscale(optimizer)
    for optimizer in optimizers:
        fire(trainer.callbacks, "before_optimizer_step", trainer, module, optimizer=optimizer)
    t = trainer.config.trainer
    norm = clip_gradients(optimizers, t.gradient_clip_val, t.gradient_clip_algorithm)
    if norm is not None:
        trainer.last_grad_norm = norm
    for optimizer in optimizers:
        distributed = hasattr(optimizer, "skip_synchronize")
        with optimizer.skip_synchronize() if distributed else contextlib.nullcontext():
            precision.step(optimizer, update=False)
    precision.update()
