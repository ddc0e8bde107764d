"""Row-sparse push_pull of torch sparse gradients (``nn.Embedding(sparse=True)``).

    grad = model.embedding.weight.grad          # a sparse COO tensor
    model.embedding.weight.grad = bps.sparse_push_pull(grad, name="embedding")

Only the rows some rank touched travel, each to the server that owns its id
(``id % num_servers``); the result holds the union of those rows, averaged over ranks
(see :mod:`bpstrain._sparse`). Collective, like every push_pull. CUDA gradients are
copied to the host and back. ``DistributedOptimizer`` sends the sparse gradients of
parameters of 1 MiB or more this way by itself (smaller ones share dense fused buckets).
"""

from __future__ import annotations

import torch

from bpstrain import _sparse


def sparse_push_pull_async(tensor: torch.Tensor, name: str, average: bool = True, priority: int = 0):
    """Starts :func:`sparse_push_pull`; :func:`synchronize_sparse` waits for it."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError(f"sparse_push_pull takes a sparse COO tensor. Received: {type(tensor).__name__}"
                         + (f" with layout {tensor.layout}" if isinstance(tensor, torch.Tensor) else ""))
    if tensor.sparse_dim() != 1:
        raise ValueError("sparse_push_pull takes row-sparse tensors (sparse_dim 1, as embedding "
                         f"gradients). Received: sparse_dim {tensor.sparse_dim()}")
    coalesced = tensor.detach().coalesce().cpu()
    ids = coalesced.indices()[0].numpy()
    width = int(torch.Size(tensor.shape[1:]).numel())
    rows = coalesced.values().to(torch.float32).reshape(ids.shape[0], width).numpy()
    return tensor, _sparse.start(ids, rows, name, tensor.shape[0], average, priority)


def synchronize_sparse(started) -> torch.Tensor:
    """The coalesced sparse COO result of :func:`sparse_push_pull_async`."""
    tensor, pending = started
    out_ids, out_rows = _sparse.finish(pending)
    values = torch.from_numpy(out_rows).reshape(-1, *tensor.shape[1:]).to(tensor.dtype)
    # finish() returns unique ids in ascending order: coalesced already (no second sort).
    result = torch.sparse_coo_tensor(torch.from_numpy(out_ids)[None], values, tensor.shape, is_coalesced=True)
    return result.to(tensor.device)


def sparse_push_pull(tensor: torch.Tensor, name: str, average: bool = True) -> torch.Tensor:
    """Sums (averages) a sparse COO tensor's rows over all ranks; returns a coalesced
    sparse COO tensor of the same shape holding the union of the rows."""
    return synchronize_sparse(sparse_push_pull_async(tensor, name, average))
