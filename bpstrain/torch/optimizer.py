"""DistributedOptimizer: averages gradients over ranks while backward still runs.

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    loss.backward()        # each gradient starts its push_pull as soon as it is ready
    optimizer.step()       # waits for them, then updates

Gradient clipping::

    loss.backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with optimizer.skip_synchronize():
        optimizer.step()

A hook per parameter (``register_post_accumulate_grad_hook``) starts its push_pull
with priority ``-index`` (front layers first: they are needed first by the next
forward pass). Parameters under ``fusion_threshold_bytes`` (1 MiB) travel in shared
buckets, sent when their last member is ready (:mod:`bpstrain.torch._fusion`). At ``step()``/``synchronize()`` every parameter that requires a
gradient and whose hook did not fire (unused on this rank, ``None`` gradient, frozen
when the optimizer was built and unfrozen since) is push_pulled too, as zeros when it
has no gradient, so all ranks issue the same operations and nobody waits forever.
"""

from __future__ import annotations

import itertools
import warnings
from contextlib import contextmanager

import torch

from bpstrain._compression import check_momentum_correction
from bpstrain.torch import _compressors, _fusion, _tensors, _unused, ops
from bpstrain.torch.compression import Compression

_STATE_KEY = "bpstrain_compression"  # the compressors' entry in state_dict()

_instances = itertools.count()



def parameter_names(params, named_parameters) -> dict:
    """``{id(parameter): name}`` for an optimizer's ``params``, from ``named_parameters``
    (``model.named_parameters()``: checked to be (name, parameter) pairs with unique
    names that cover every parameter) or, when None, ``noname.<index>``."""
    if named_parameters is None:
        return {id(p): f"noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) "
                         "tuples, usually model.named_parameters(). Received: "
                         f"{[type(item).__name__ for item in named[:3]]}")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         f"Received duplicates: {', '.join(dups)}")
    by_id = {id(p): n for n, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError("named_parameters was given but does not name every parameter "
                         "of the optimizer. Received: unnamed parameter indices "
                         f"{missing[:10]}")
    return by_id

class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the wrapped optimizer's class."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 fusion_threshold_bytes, average=True, catch_up=False):
        super(self.__class__, self).__init__(params)
        self._bps_average = average
        self.rounds = 0  # rounds this model has taken: its own steps and caught-up ones
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1. Received: "
                             f"backward_passes_per_step={backward_passes_per_step}")
        all_params = [p for group in self.param_groups for p in group["params"]]
        by_id = parameter_names(all_params, named_parameters)
        # The instance number keeps two optimizers with equal parameter names apart.
        prefix = f"DistributedOptimizer.{next(_instances)}.grad."
        self._bps_names = {id(p): prefix + by_id[id(p)] for p in all_params}
        self._bps_priority = {id(p): -i for i, p in enumerate(all_params)}
        self._bps_keys = {id(p): by_id[id(p)] for p in all_params}  # stable across rebuilds
        self._bps_compression = compression
        # Stateful (lossy) compression works per parameter, by name: such parameters stay
        # out of the fused buckets, which keep a classic compressor (none/fp16/bf16).
        self._bps_codec = _compressors.for_optimizer(compression)
        self._bps_classic = {}  # id(p) -> classic compressor of an unfused parameter
        self._bps_stateful = {}  # id(p) -> GradientCompressor
        if self._bps_codec is not None:
            self._bps_compression = self._bps_codec.bucket_compressor()
            for p in all_params:
                classic, stateful = self._bps_codec.choose(by_id[id(p)], p.numel())
                if stateful is not None:
                    self._bps_stateful[id(p)] = stateful
                else:
                    self._bps_classic[id(p)] = classic
            _check_momentum_correction(self.param_groups, self._bps_stateful)
        self.backward_passes_per_step = backward_passes_per_step
        self._bps_delay = {id(p): backward_passes_per_step for p in all_params}
        self._bps_handles = {}  # id(p) -> (p, handle, (compressed, ctx)) of unfused parameters
        self._bps_fired = set()  # parameters whose gradient is final for this step
        self._bps_had_grad = {}  # id(p) -> False when synchronize() supplied zeros
        self._bps_sparse = {}  # id(p) -> (p, started row-sparse push_pull) of this step
        self._bps_sparse_params = set()  # parameters whose gradients came sparse (embeddings)
        bucket_bytes = max(int(ops._runtime().chunk_bytes), 1 << 20)
        self._bps_buckets = _fusion.plan_buckets(all_params, prefix, fusion_threshold_bytes,
                                                 bucket_bytes, exclude=set(self._bps_stateful))
        self._bps_bucket_of = {id(p): b for b in self._bps_buckets for p in b.params}
        self._bps_hooked = set()
        self._bps_synchronized = False
        self._bps_should_synchronize = True
        self._bps_active = ops.distributed()
        self._bps_catch_up = bool(catch_up) and self._bps_active
        if self._bps_catch_up:
            _check_catch_up(all_params, compression, average, backward_passes_per_step)
        if self._bps_active:
            self._bps_register_hooks()

    def _bps_params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def _bps_register_hooks(self):
        for p in self._bps_params():
            if p.requires_grad and id(p) not in self._bps_hooked:
                p.register_post_accumulate_grad_hook(self._bps_make_hook())
                self._bps_hooked.add(id(p))

    def _bps_make_hook(self):
        def hook(p):
            key = id(p)
            if key not in self._bps_delay:  # parameter added after construction
                return
            if self._bps_delay[key] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    f"locally. Received: backward_passes_per_step={self.backward_passes_per_step}")
            self._bps_delay[key] -= 1
            if self._bps_delay[key] == 0:
                self._bps_ready(p)
        return hook

    def _bps_ready(self, p):
        """``p.grad`` is final for this step: start its push_pull (or its bucket's)."""
        self._bps_fired.add(id(p))
        bucket = self._bps_bucket_of.get(id(p))
        if bucket is None:
            if p.grad is not None and p.grad.is_sparse:
                # nn.Embedding(sparse=True): only the touched rows travel (bpstrain.torch.sparse).
                from bpstrain.torch.sparse import sparse_push_pull_async

                self._bps_sparse_params.add(id(p))
                self._bps_sparse[id(p)] = (p, sparse_push_pull_async(
                    p.grad, self._bps_names[id(p)] + ".sparse", self._bps_average, self._bps_priority[id(p)]))
                return
            self._bps_handles[id(p)] = (p,) + self._bps_push_pull_async(p)
            return
        bucket.ready.add(id(p))
        if bucket.handle is None and bucket.complete():
            bucket.launch(self._bps_compression, self._bps_average)

    def _bps_push_pull_async(self, p):
        grad = p.grad
        stateful = self._bps_stateful.get(id(p))
        if stateful is not None:  # its handle's result is the average itself
            handle = stateful.push_pull_async(grad, self._bps_names[id(p)], self._bps_average,
                                              self._bps_priority[id(p)], key=self._bps_keys[id(p)],
                                              inplace=True)
            return handle, (None, None)
        compression = self._bps_classic.get(id(p), self._bps_compression)
        compressed, ctx = compression.compress(grad)
        handle = ops.push_pull_async_inplace(compressed, average=self._bps_average,
                                             name=self._bps_names[id(p)],
                                             priority=self._bps_priority[id(p)])
        return handle, (compressed, ctx)

    def in_flight(self) -> int:
        """Number of push_pulls started by the hooks and not yet synchronized."""
        return (len(self._bps_handles) + len(self._bps_sparse)
                + sum(b.handle is not None for b in self._bps_buckets))

    def synchronize(self):
        """Waits for every gradient's push_pull; afterwards ``p.grad`` holds the average."""
        if not self._bps_active:
            self._bps_synchronized = True
            return
        self._bps_launch_missing()
        try:
            for key, (p, handle, ctx) in list(self._bps_handles.items()):
                self._bps_finish_param(p, handle, ctx)
            for bucket in self._bps_buckets:
                if bucket.handle is not None:
                    bucket.finish(self._bps_compression, self._bps_had_grad)
            if self._bps_sparse:
                from bpstrain.torch.sparse import synchronize_sparse

                for key, (p, started) in list(self._bps_sparse.items()):
                    p.grad = synchronize_sparse(started)
                    if self._bps_had_grad.get(key) is False and p.grad._nnz() == 0:
                        p.grad = None  # unused on every rank, as in a local run
        finally:
            self._bps_end_step()
        self._bps_synchronized = True

    def _bps_launch_missing(self):
        """Starts the push_pulls whose hooks did not fire, so every rank issues the same set."""
        # Same set on every rank: what requires a gradient now, in parameter order.
        for p in self._bps_params():
            key = id(p)
            if key not in self._bps_names or not p.requires_grad or key in self._bps_fired:
                continue
            # Unused here, maybe used elsewhere: contribute zeros rather than hang (no rows,
            # for an embedding whose gradients come sparse).
            if key in self._bps_sparse_params and p.grad is None and key not in self._bps_bucket_of:
                self._bps_had_grad[key] = False
                p.grad = torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.long),
                                                 torch.zeros((0, *p.shape[1:]), dtype=p.dtype), p.shape)
            else:
                self._bps_had_grad[key] = _unused.zeros_if_missing(p)
            self._bps_ready(p)
        for bucket in self._bps_buckets:  # buckets whose members are partly frozen
            if bucket.handle is None and any(q.requires_grad for q in bucket.params):
                bucket.launch(self._bps_compression, self._bps_average)
        self._bps_register_hooks()  # parameters unfrozen since construction

    def _bps_finish_param(self, p, handle, ctx, had_grad=None):
        """Waits for an unfused parameter's push_pull and leaves the average in ``p.grad``."""
        compressed, cctx = ctx
        result = ops.synchronize(handle)
        if compressed is None:  # a stateful compressor's result
            _compressors.copy_result(p.grad, result)
        elif compressed is not p.grad:
            compression = self._bps_classic.get(id(p), self._bps_compression)
            p.grad.copy_(compression.decompress(compressed, cctx))
        had_grad = self._bps_had_grad if had_grad is None else had_grad
        _unused.none_if_unused(p, had_grad.get(id(p)))

    def _bps_end_step(self, reset_buckets=True):
        """Forgets this step's operations (the next backward starts afresh)."""
        for key in self._bps_delay:
            self._bps_delay[key] = self.backward_passes_per_step
        for bucket in self._bps_buckets if reset_buckets else ():
            bucket.reset()
        self._bps_handles.clear()
        self._bps_sparse.clear()
        self._bps_fired.clear()
        self._bps_had_grad.clear()

    def state_dict(self, server_state: bool = False):
        """The wrapped optimizer's state, plus the compressors' (error-feedback residuals,
        PowerSGD's Q, step counters, auto's decisions) under ``"bpstrain_compression"``,
        keyed by parameter name: each rank saves its own (residuals differ by rank).

        Args:
            server_state: also fetch the servers' residuals of onebit/top-k/dithering
                parameters, so that a resumed job answers exactly what this one would
                have. **Collective**: every rank must call it at the same point (costs
                about one dense copy of those gradients on the wire). Without it a
                resumed job starts the servers' residuals at zero.
        """
        state = super(self.__class__, self).state_dict()
        if self._bps_codec is not None:
            state[_STATE_KEY] = self._bps_codec.state_dict()
            if server_state:
                state[_STATE_KEY]["servers"] = self._bps_server_residuals()
        return state

    def load_state_dict(self, state_dict):
        """Restores :meth:`state_dict`; the next step continues as if never interrupted.

        When the state carries the servers' residuals (``state_dict(server_state=True)``)
        they are sent back to the servers: then this call is collective too.
        """
        state_dict = dict(state_dict)
        codec_state = state_dict.pop(_STATE_KEY, None)
        super(self.__class__, self).load_state_dict(state_dict)
        if codec_state is not None and self._bps_codec is not None:
            self._bps_codec.load_state_dict(codec_state)
            servers = codec_state.get("servers", {})
            if servers and self._bps_active:
                for p, comp in self._bps_byte_codecs():
                    residual = servers.get(self._bps_keys[id(p)])
                    if residual is not None:
                        comp.import_server_residual(self._bps_names[id(p)], p.numel(), residual)

    def _bps_byte_codecs(self):
        """(parameter, compressor) of the parameters the servers keep residuals for, in
        parameter order (the same on every rank)."""
        out = []
        for p in self._bps_params():
            comp = self._bps_stateful.get(id(p))
            if (isinstance(comp, _compressors.AutoCompressor)
                    and comp.decision(self._bps_keys[id(p)]) is not False):
                comp = comp.inner  # auto still compressing this one: its codec's residual
            if isinstance(comp, _compressors.ByteCodecCompressor) and comp.spec.server_error_feedback:
                out.append((p, comp))
        return out

    def _bps_server_residuals(self):
        if not self._bps_active:
            return {}
        return {self._bps_keys[id(p)]: comp.export_server_residual(self._bps_names[id(p)], p.numel())
                for p, comp in self._bps_byte_codecs()}

    @contextmanager
    def skip_synchronize(self):
        """Makes ``step()`` skip synchronizing (after an explicit ``synchronize()``)."""
        self._bps_should_synchronize = False
        try:
            yield
        finally:
            self._bps_should_synchronize = True

    def step(self, closure=None):
        """Synchronizes the gradients (unless inside ``skip_synchronize()``), then steps."""
        if self._bps_should_synchronize:
            if self._bps_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.")
            self.synchronize()
        self._bps_synchronized = False
        loss = super(self.__class__, self).step(closure)
        self.rounds += 1
        if self._bps_catch_up:
            self.rounds += self._bps_apply_missed_rounds()
        return loss

    def _bps_apply_missed_rounds(self) -> int:
        """catch_up: applies, as optimizer steps, the rounds the other workers completed
        while this one computed (their averages, pulled without pushing), so a slow
        worker skips ahead instead of holding the others back. Returns how many."""
        from bpstrain import engine
        from bpstrain.engine import Op

        targets = []  # (name, tensor receiving the average, priority)
        for p in self._bps_params():
            if p.requires_grad and id(p) not in self._bps_bucket_of:
                _unused.zeros_if_missing(p)
                targets.append((self._bps_names[id(p)], p.grad, self._bps_priority[id(p)]))
        buckets = [b for b in self._bps_buckets if any(q.requires_grad for q in b.params)]
        for b in buckets:
            if b.buffer is None:
                b.buffer = torch.zeros(b.numel, dtype=b.params[0].dtype)
            targets.append((b.name, b.buffer, b.priority))
        behind = min((engine.rounds_behind(name) for name, _, _ in targets), default=0)
        for _ in range(behind):
            handles = []
            for name, tensor, priority in targets:
                view = _tensors.host_view(tensor)
                handles.append(engine.submit(name, ops._DTYPES[tensor.dtype], view.shape or (1,), view, view,
                                             Op.AVERAGE, priority=priority, pull_only=True))
            for handle in handles:
                engine.synchronize(handle)
            for b in buckets:
                for p, view in zip(b.params, b.views()):
                    if p.requires_grad:
                        _unused.zeros_if_missing(p)
                        p.grad.copy_(view)
            super(self.__class__, self).step()
        return behind

    def zero_grad(self, set_to_none: bool = True):
        """Like the wrapped optimizer's; refused while push_pulls are in flight."""
        if self.in_flight():
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def _check_momentum_correction(param_groups, stateful: dict) -> None:
    """Each momentum-corrected parameter's group must be an SGD of the spec's momentum."""
    for group in param_groups:
        for p in group["params"]:
            spec = getattr(stateful.get(id(p)), "spec", None)
            if spec is not None:
                check_momentum_correction(spec, group.get("momentum"), group.get("dampening", 0),
                                          group.get("nesterov", False))


def _check_catch_up(params, compression, average, backward_passes_per_step) -> None:
    from bpstrain import engine

    if engine.options().get("aggregate", "all") == "all":
        raise ValueError("catch_up=True needs k-of-n aggregation (comm.aggregate=k:<K>): only then do the "
                         "others finish rounds without this worker")
    if compression is not Compression.none or not average or backward_passes_per_step != 1:
        raise ValueError("catch_up=True takes averaged, uncompressed gradients of every backward pass "
                         "(no compression, op=Sum or backward_passes_per_step)")
    if any(p.is_cuda for p in params):
        raise ValueError("catch_up=True works on CPU parameters (CUDA ones are not staged for it yet)")


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, fusion_threshold_bytes=1 << 20, op=None,
                         catch_up=False):
    """Wraps a ``torch.optim`` optimizer so that ``step()`` uses rank-averaged gradients.

    The result is an instance of a dynamic subclass of ``type(optimizer)`` (as in
    Horovod), so ``isinstance(opt, torch.optim.SGD)`` still holds; it shares the
    wrapped optimizer's parameter groups, defaults and state.

    Args:
        optimizer: the optimizer to wrap.
        named_parameters: ``model.named_parameters()``; names the push_pulls (must be
            unique and cover every parameter of the optimizer).
        compression: ``Compression.none`` / ``fp16`` / ``bf16`` (or a user's
            compress/decompress class), a stateful compressor (``Compression.onebit()``,
            ``topk(ratio)``, ``randomk(ratio)``, ``dithering(levels)``,
            ``powersgd(rank)``, ``auto(...)``), ``Compression.policy(...)`` (rules per
            parameter name and size), or a spec string such as ``"topk:0.01"``. Lossy
            ones apply per parameter (min_size 1024 elements unless a policy says
            otherwise) with worker-side error feedback; their state is part of
            ``state_dict()``. The optimizer takes its own copy of a stateful compressor.
        backward_passes_per_step: local accumulation: gradients of this many backward
            passes are summed locally, then averaged over ranks once.
        fusion_threshold_bytes: parameters smaller than this share push_pulls (see
            :mod:`bpstrain.torch._fusion`); 0 gives every parameter its own.
        op: Horovod's ``bpstrain.torch.Average`` (default) or ``Sum`` of the gradients;
            ``Adasum`` raises ``NotImplementedError`` naming the alternative.
        catch_up: under k-of-n aggregation (``comm.aggregate=k:<K>``), a worker that fell
            behind applies the rounds the others completed meanwhile at its next
            ``step()`` (their averages, as optimizer steps; it computes no gradients for
            them), so a persistently slow worker skips ahead instead of setting the
            pace. ``optimizer.rounds`` then counts the rounds the model took, which can
            grow by more than one a step: **end the training loop by rounds**
            (``while optimizer.rounds < total``), or the workers run different numbers
            of rounds and the last ones wait for a partner that stopped. CPU parameters.

    Under ``comm.consistency`` ``ssp:<s>`` or ``async`` the servers hold the weights and
    apply SGD or Adam themselves: see :mod:`bpstrain.torch.server_optimizer`.

    Raises:
        ValueError: duplicate names, parameters missing from ``named_parameters``, or an
            optimizer that is already wrapped (its hooks would push_pull every gradient twice).
    """
    from bpstrain import engine
    from bpstrain.torch.mpi_ops import _average

    methods = _DistributedOptimizer.__dict__
    if engine.options().get("consistency", "sync") != "sync":
        from bpstrain.torch.server_optimizer import _ServerOptimizer

        methods = _ServerOptimizer.__dict__
    return _wrap(optimizer, methods, named_parameters, compression,
                 backward_passes_per_step, fusion_threshold_bytes, _average(None, op), catch_up)


def _wrap(optimizer, methods, *args):
    """An instance of a dynamic subclass of ``type(optimizer)`` with ``methods`` mixed in."""
    if hasattr(optimizer, "_bps_names"):
        raise ValueError("the optimizer is already a bpstrain DistributedOptimizer; wrap the "
                         f"plain torch optimizer instead. Received: {type(optimizer).__name__}")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(methods))
    wrapped = cls(optimizer.param_groups, *args)
    # The subclass was built from param_groups alone: keep the original's defaults (for
    # add_param_group) and any state it already had (e.g. loaded from a checkpoint).
    wrapped.defaults = dict(optimizer.defaults)
    wrapped.state.update(optimizer.state)
    return wrapped
