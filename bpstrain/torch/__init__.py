"""PyTorch adapter: ``import bpstrain.torch as bps`` instead of ``byteps.torch``/``horovod.torch``.

    import torch
    import bpstrain.torch as bps

    bps.init()
    torch.cuda.set_device(bps.local_rank())          # when training on GPUs
    model = build_model().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * bps.size())
    optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(optimizer, root_rank=0)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

Run it with ``python -m bpstrain.launch --workers 4 --servers 2 -- python train.py``,
or alone (``python train.py``: rank 0 of 1). Modules: :mod:`.ops` (collectives),
:mod:`.optimizer`, :mod:`.cross_barrier` (step() without the barrier), :mod:`.functions` (broadcast helpers), :mod:`.parallel` (DDP),
:mod:`.compression`, :mod:`.mpi_ops` (Horovod's allreduce/allgather/barrier),
:mod:`.sync_batch_norm`, :mod:`.sparse` (row-sparse push_pull), :mod:`.embedding` (layers
whose table the servers keep), :mod:`.process_group` (the ``torch.distributed`` backend
``"bpstrain"``, registered on import), :mod:`.elastic` (``ElasticSampler``, and the
``TorchState`` a worker joining the running job gets); CUDA staging lives in :mod:`._cuda`.
"""

from bpstrain.torch import elastic, parallel
from bpstrain.torch.compression import Compression
from bpstrain.torch.cross_barrier import CrossBarrier
from bpstrain.torch.elastic import ElasticSampler
from bpstrain.torch.functions import (broadcast_object, broadcast_optimizer_state,
                                      broadcast_parameters)
from bpstrain.torch.ops import (broadcast, broadcast_, broadcast_async, broadcast_async_, declare,
                                distributed, init, is_initialized, local_rank, local_size, poll,
                                push_pull, push_pull_async, push_pull_async_inplace,
                                push_pull_inplace, rank, shutdown, size, synchronize)
from bpstrain.torch.mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allreduce,
                                    allreduce_, allreduce_async, allreduce_async_, barrier, join)
from bpstrain.embedding_table import EmbeddingTable
from bpstrain.torch.embedding import ServerEmbedding, ServerEmbeddingBag
from bpstrain.torch.optimizer import DistributedOptimizer
from bpstrain.torch.sparse import sparse_push_pull
from bpstrain.torch.sync_batch_norm import SyncBatchNorm
from bpstrain.torch import process_group as _process_group

_process_group.register()

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "Sum", "SyncBatchNorm", "allgather",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "barrier", "join",
    "Compression", "CrossBarrier", "DistributedOptimizer", "ElasticSampler", "EmbeddingTable", "ServerEmbedding",
    "ServerEmbeddingBag", "sparse_push_pull", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "declare", "distributed", "init", "is_initialized", "local_rank", "local_size", "parallel",
    "poll", "push_pull", "push_pull_async", "push_pull_async_inplace", "push_pull_inplace",
    "rank", "shutdown", "size", "synchronize",
]
