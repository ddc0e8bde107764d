"""MXNet adapter: ``import bpstrain.mxnet as bps`` (BytePS's ``byteps.mxnet``).

Needs MXNet 1.9 (``pip install 'bpstrain[mxnet]'``: mxnet==1.9.1, which requires
numpy < 2, so it usually lives in a virtual environment of its own). The
``numpy.bool`` alias MXNet 1.9 reads on numpy 1.24-1.26 is restored by this module
before it imports MXNet; scripts need no shim of their own.

Gluon, run with ``python -m bpstrain.launch --workers 2 -- python train.py``::

    import mxnet as mx
    from mxnet import autograd, gluon
    import bpstrain.mxnet as bps

    bps.init()
    net = make_net()
    net.initialize(mx.init.Xavier())
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.01 * bps.size()})
    for data, label in batches:                   # this worker's share
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(data.shape[0])               # gradients averaged over the ranks

A plain ``gluon.Trainer`` takes the kvstore instead:
``gluon.Trainer(params, "sgd", {...}, kvstore=bps.KVStore(), update_on_kvstore=False)``
(it sums over ranks, as MXNet's ``dist_sync``; ``KVStore(average=True)`` averages).
For the Module API, ``bps.DistributedOptimizer(mx.optimizer.SGD(...))`` (with
``kvstore=None``), ``bps.broadcast_parameters(module.get_params()[0])`` and
``bps.push_pull(ndarray, name=...)`` are BytePS's calls.

Operations are synchronous and in place; supported dtypes: float16, float32, float64,
uint8, int8, int32, int64. A shape or dtype that differs between ranks for one name
raises ``bpstrain.errors.MismatchError`` and the job stays usable; a dead peer raises
``PeerError``; nothing waits longer than the engine's op timeout.
"""

from bpstrain.engine import (barrier, init, is_initialized, local_rank, local_size, rank,
                             shutdown, size)
from bpstrain.errors import BpsError, MismatchError, PeerError
from bpstrain.mxnet._ops import KVStore, broadcast, broadcast_parameters, push_pull
from bpstrain.mxnet._trainer import DistributedOptimizer, DistributedTrainer

__all__ = [
    "BpsError", "DistributedOptimizer", "DistributedTrainer", "KVStore", "MismatchError", "PeerError", "barrier",
    "broadcast", "broadcast_parameters", "init", "is_initialized", "local_rank", "local_size",
    "push_pull", "rank", "shutdown", "size",
]
