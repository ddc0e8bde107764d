"""Parameters without a gradient on some rank: zeros go out, ``None`` comes back.

Every rank must issue the same push_pulls, so a parameter that got no gradient here
(unused in this rank's forward pass) contributes zeros rather than leaving the others
waiting. When the average comes back all zeros and this rank had no gradient, the
parameter was unused everywhere: its gradient is ``None`` again, as in a local run.
"""

from __future__ import annotations

from typing import Optional

import torch


def zeros_if_missing(p: torch.Tensor) -> bool:
    """Gives ``p`` a zero gradient when it has none; returns whether it had one."""
    if p.grad is not None:
        return True
    p.grad = torch.zeros_like(p)
    return False


def none_if_unused(p: torch.Tensor, had_grad: Optional[bool]) -> None:
    """Sets ``p.grad`` back to ``None`` when this rank sent zeros and every rank did."""
    if had_grad is False and p.grad is not None and not bool(p.grad.any()):
        p.grad = None
