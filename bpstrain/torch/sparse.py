"""Row-sparse push_pull of torch sparse gradients (``nn.Embedding(sparse=True)``).

    grad = model.embedding.weight.grad          # a sparse COO tensor
    model.embedding.weight.grad = bps.sparse_push_pull(grad, name="embedding")

Only the rows some rank touched travel, each to the server that owns its id
(``id % num_servers``); the result holds the union of those rows, averaged over ranks
(see :mod:`bpstrain._sparse`). Collective, like every push_pull. CUDA gradients are
copied to the host and back. ``DistributedOptimizer`` does not route sparse gradients
here by itself yet: call it for such parameters (e.g. between ``synchronize()`` and
``step()``), and leave them out of the optimizer's dense push_pulls.
"""

from __future__ import annotations

import torch

from bpstrain import _sparse


def sparse_push_pull(tensor: torch.Tensor, name: str, average: bool = True) -> torch.Tensor:
    """Sums (averages) a sparse COO tensor's rows over all ranks; returns a coalesced
    sparse COO tensor of the same shape holding the union of the rows."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError(f"sparse_push_pull takes a sparse COO tensor. Received: {type(tensor).__name__}"
                         + (f" with layout {tensor.layout}" if isinstance(tensor, torch.Tensor) else ""))
    if tensor.sparse_dim() != 1:
        raise ValueError("sparse_push_pull takes row-sparse tensors (sparse_dim 1, as embedding "
                         f"gradients). Received: sparse_dim {tensor.sparse_dim()}")
    coalesced = tensor.detach().coalesce().cpu()
    ids = coalesced.indices()[0].numpy()
    rows = coalesced.values().to(torch.float32).reshape(ids.shape[0], -1).numpy()
    out_ids, out_rows = _sparse.sparse_push_pull(ids, rows, name, tensor.shape[0], average)
    values = torch.from_numpy(out_rows).reshape(-1, *tensor.shape[1:]).to(tensor.dtype)
    result = torch.sparse_coo_tensor(torch.from_numpy(out_ids)[None], values, tensor.shape)
    return result.coalesce().to(tensor.device)
