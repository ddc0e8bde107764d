"""BytePS's ``byteps.mxnet`` training wrappers: DistributedTrainer (a ``gluon.Trainer``)
and DistributedOptimizer (an ``mx.optimizer.Optimizer``, for the Module API)."""

from __future__ import annotations

from typing import Optional

from bpstrain import engine
from bpstrain.mxnet._compat import import_mxnet
from bpstrain.mxnet._ops import KVStore, exchange, write

mx = import_mxnet()


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` whose gradients are averaged over all ranks by bpstrain.

    ::

        trainer = bps.DistributedTrainer(net.collect_params(), "sgd",
                                         {"learning_rate": 0.01 * bps.size()})
        ...
        trainer.step(batch_size)                  # this worker's batch size

    With the per-worker ``batch_size``, N workers on batches of B take the step one
    process takes on their N*B samples (the gradients are averaged over ranks, then
    scaled by ``1/batch_size`` as usual). Every parameter takes ``root_rank``'s value
    when the trainer is created, so ranks need not initialize alike; a parameter
    still uninitialized then (deferred initialization: no ``in_units``/``in_channels``)
    takes it at the first step, after that step's gradients were computed, so either
    run one forward pass before creating the trainer or seed every rank alike
    (``mx.random.seed``). Each step push_pulls every gradient as one engine group, the
    first parameter (sorted by name, as ``gluon.Trainer`` orders a ``ParameterDict``)
    first. ``allreduce_grads()`` + ``update()`` work as with ``gluon.Trainer``.

    Args:
        params: a ``ParameterDict`` (``net.collect_params()``) or list of Parameters.
        optimizer, optimizer_params: as for ``gluon.Trainer``.
        root_rank: the rank whose initial parameters everyone starts from.
        compression_params: only None (BytePS's onebit/topk compressors are not offered).
        name: engine name prefix, the same on every rank (default: numbered in creation
            order, so every rank must create its trainers in the same order).

    Raises:
        ValueError: ``compression_params`` given, or (at the first step) sparse gradients.
    """

    def __init__(self, params, optimizer, optimizer_params=None, root_rank: int = 0,
                 compression_params=None, name: Optional[str] = None):
        if isinstance(optimizer, DistributedOptimizer):  # BytePS unwraps it too
            optimizer = optimizer._optimizer
        if compression_params:
            raise ValueError("bpstrain.mxnet.DistributedTrainer does not compress gradients "
                             f"(BytePS's compressors are not offered). Received: "
                             f"compression_params={compression_params!r}")
        self.root_rank = int(root_rank)
        self._bps_kvstore = KVStore(average=True, root_rank=root_rank,
                                    name=name or engine.auto_name("mx.trainer"))
        super().__init__(params, optimizer, optimizer_params, kvstore=self._bps_kvstore,
                         update_on_kvstore=False)
        self._init_params()  # now: the first step's gradients are taken at root's values

    def _init_params(self):
        # gluon.Trainer broadcasts one parameter at a time, and only at the first step;
        # here they form one group, sent as soon as they are initialized.
        ready = [p for p in self._params_to_init if not p._deferred_init]
        if ready:
            self._bps_kvstore.broadcast([self._param2idx[p.name] for p in ready],
                                    [p.list_data()[0] for p in ready],
                                    [p.list_data() for p in ready])
        self._params_to_init = [p for p in self._params_to_init if p._deferred_init]

    def _allreduce_grads(self):
        indices = [i for i, p in enumerate(self._params) if p.grad_req != "null"]
        grads = [self._params[i].list_grad() for i in indices]
        sparse = [self._params[i].name for i, g in zip(indices, grads) if g[0].stype != "default"]
        if sparse:
            raise ValueError("bpstrain.mxnet push_pulls dense gradients only. Received: sparse "
                             f"gradients for {', '.join(sparse)}")
        if indices:
            self._kvstore.pushpull(indices, grads)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an MXNet optimizer so that each update first averages its gradients over ranks.

    BytePS's ``byteps.mxnet.DistributedOptimizer``, for the Module API (``kvstore=None``)
    or a ``gluon.Trainer(..., kvstore=None)``; every other attribute is the wrapped
    optimizer's. The gradients of one update call (several with MXNet's aggregated
    updates) are push_pulled as one group, named by parameter index. Ranks must start
    from the same parameters (``broadcast_parameters``).

    Args:
        optimizer: an ``mx.optimizer.Optimizer``.
        name: engine name prefix, the same on every rank (default: numbered in creation
            order).
    """

    def __init__(self, optimizer, name: Optional[str] = None):
        # The wrapped optimizer keeps every setting: the base initializer would shadow them.
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_prefix", name or engine.auto_name("mx.optimizer"))

    def __getattr__(self, item):
        if item == "_optimizer":  # not set yet (unpickling): no recursion
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, item, value):
        setattr(self._optimizer, item, value)  # e.g. gluon.Trainer's param_dict

    def __getstate__(self):  # Updater.get_states(dump_optimizer=True) pickles the optimizer
        return dict(vars(self))

    def __setstate__(self, state):
        for key, value in state.items():
            object.__setattr__(self, key, value)

    def _push_pull(self, index, grad):
        indices = list(index) if isinstance(index, (list, tuple)) else [index]
        grads = list(grad) if isinstance(grad, (list, tuple)) else [grad]
        write([[g] for g in grads],
              exchange("push_pull", grads, [f"{self._prefix}.{i}" for i in indices],
                       priorities=[-int(i) for i in indices]))

    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    def update(self, index, weight, grad, state):
        self._push_pull(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        self._push_pull(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr):
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        self._optimizer.set_wd_mult(args_wd_mult)
