"""Horovod's ``SyncBatchNorm``: batch statistics over every rank's batch.

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), bps.SyncBatchNorm(8), ...)
    model = bps.SyncBatchNorm.convert_sync_batchnorm(model)   # or convert an existing one

In training mode, the mean and variance are those of the union of all ranks' batches:
two push_pulls per forward (the sums and row count, then the squared deviations from
the global mean, which stays accurate where E[x²]−E[x]² would cancel), both
differentiable, so the backward pass sums their gradients over ranks too. Evaluation
mode uses the running statistics like ``BatchNorm``. Works on CPU and CUDA; every rank
must run the same forwards (the statistics are collectives).
"""

from __future__ import annotations

import itertools

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from bpstrain.torch import ops

_instances = itertools.count()


class SyncBatchNorm(_BatchNorm):
    """Batch normalization with statistics over all ranks (any input of 2+ dimensions).

    Args: as ``torch.nn.BatchNorm*d``: ``num_features, eps, momentum, affine,
    track_running_stats``.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self._name = f"SyncBatchNorm.{next(_instances)}"

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of 2 or more dimensions (N, C, ...). "
                             f"Received: input.dim()={input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or ops.size() == 1:
            return super().forward(input)
        dims = [0] + list(range(2, input.dim()))
        shape = [1, -1] + [1] * (input.dim() - 2)
        local_rows = torch.tensor([input.numel() // input.shape[1]], dtype=input.dtype,
                                  device=input.device)
        sums = ops.push_pull(torch.cat([input.sum(dims), local_rows]), average=False,
                             name=f"{self._name}.sum")
        count = sums[-1]
        mean = sums[:-1] / count
        centered = input - mean.view(shape)
        var = ops.push_pull((centered * centered).sum(dims), average=False,
                            name=f"{self._name}.sqdev") / count
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), float(count))
        return out

    @torch.no_grad()
    def _update_running_stats(self, mean, var, count: float) -> None:
        self.num_batches_tracked += 1
        momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                    else self.momentum)
        unbiased = var * (count / max(count - 1.0, 1.0))
        self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Returns ``module`` with every ``BatchNorm*d`` replaced by a SyncBatchNorm
        (weights, buffers and mode kept), like ``torch.nn.SyncBatchNorm``'s."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats)
            with torch.no_grad():
                if module.affine:
                    out.weight.copy_(module.weight)
                    out.bias.copy_(module.bias)
                if module.track_running_stats:
                    out.running_mean.copy_(module.running_mean)
                    out.running_var.copy_(module.running_var)
                    out.num_batches_tracked.copy_(module.num_batches_tracked)
            like = next(itertools.chain(module.parameters(), module.buffers()), None)
            if like is not None:
                out = out.to(like.device)
            out.train(module.training)
        for child_name, child in module.named_children():
            out.add_module(child_name, cls.convert_sync_batchnorm(child))
        return out
