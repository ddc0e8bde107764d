"""Optimizer, loss and accuracy from the config's names (torch)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn


def base_lr(opt_cfg: Any, size: int) -> float:
    """The learning rate after Horovod's ``scale_lr`` convention (lr * workers)."""
    return float(opt_cfg.lr) * (size if opt_cfg.scale_lr else 1)


def build_optimizer(opt_cfg: Any, params, size: int) -> torch.optim.Optimizer:
    """A torch optimizer for ``optimizer.name`` with the config's hyper-parameters.

    Raises:
        ValueError: An optimizer name the schema does not know.
    """
    name, lr, wd = opt_cfg.name, base_lr(opt_cfg, size), float(opt_cfg.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=float(opt_cfg.momentum),
                               weight_decay=wd, nesterov=bool(opt_cfg.nesterov))
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls(params, lr=lr, betas=tuple(opt_cfg.betas), eps=float(opt_cfg.eps),
                   weight_decay=wd)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, momentum=float(opt_cfg.momentum),
                                   eps=float(opt_cfg.eps), weight_decay=wd)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=float(opt_cfg.eps), weight_decay=wd)
    raise ValueError("optimizer.name must be one of sgd, adam, adamw, rmsprop, adagrad. "
                     f"Received: optimizer.name={name!r}")


_LOSSES = {
    "cross_entropy": nn.CrossEntropyLoss,
    "nll": nn.NLLLoss,
    "mse": nn.MSELoss,
    "l1": nn.L1Loss,
    "smooth_l1": nn.SmoothL1Loss,
    "bce_with_logits": nn.BCEWithLogitsLoss,
}
CLASSIFICATION_LOSSES = ("cross_entropy", "nll")


def build_loss(name: str) -> nn.Module:
    """The torch loss module for ``trainer.loss`` (mean reduction)."""
    if name not in _LOSSES:
        raise ValueError(f"trainer.loss must be one of {', '.join(_LOSSES)}. "
                         f"Received: trainer.loss={name!r}")
    return _LOSSES[name]()


def accuracy_fn(loss_name: str) -> Optional[Callable]:
    """``(output, target) -> number correct`` for classification losses, else None."""
    if loss_name in CLASSIFICATION_LOSSES:
        def correct(output: torch.Tensor, target: torch.Tensor) -> float:
            if output.dim() < 2 or target.dim() != output.dim() - 1:
                return float("nan")
            return float((output.argmax(dim=1) == target).sum())
        return correct
    if loss_name == "bce_with_logits":
        def correct_binary(output: torch.Tensor, target: torch.Tensor) -> float:
            if output.shape != target.shape:
                return float("nan")
            return float(((output > 0).to(target.dtype) == target).sum())
        return correct_binary
    return None
