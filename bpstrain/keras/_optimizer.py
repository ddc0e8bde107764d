"""DistributedOptimizer for Keras 3 (TensorFlow and torch backends).

The wrapper is a subclass of the user's optimizer class made on the fly (as Horovod
does), so ``isinstance``, ``get_config`` and saving behave as for the original; a
saved model loads back as the plain optimizer. Only ``apply`` (which
``apply_gradients`` and ``model.fit`` call) is overridden: it averages the gradients
over all ranks, then hands them to the original ``apply``.

How gradients reach the engine:

* torch backend, TF eagerly (``run_eagerly=True``, custom loops): converted with
  ``keras.ops.convert_to_numpy`` and back with ``keras.ops.convert_to_tensor``
  (bfloat16 gradients travel as float32 on the torch backend);
* TF backend inside ``tf.function`` (``model.fit``'s default): one
  ``tf.numpy_function`` per step for all gradients. XLA cannot compile it:
  ``model.compile(jit_compile=False)`` on GPUs (``"auto"`` already is False on CPU);
  :class:`~bpstrain.keras.callbacks.BytePSCallback` switches it off for you.
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple

import numpy as np

from bpstrain import _group
from bpstrain._compression import check_optimizer_momentum


_instances = itertools.count()


class GradientReducer:
    """Host-side state of one DistributedOptimizer: local aggregation, then push_pull.

    Args:
        prefix: Engine-name prefix; gradient ``i`` is ``<prefix>.<i>``.
        backward_passes_per_step: Gradients of this many ``apply`` calls are summed
            locally and push_pulled once; the variables change on every N-th call.
        average_aggregated_gradients: Divide the local sum by N before push_pull.
    """

    def __init__(self, prefix: str, backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False):
        if isinstance(backward_passes_per_step, bool) or not isinstance(
                backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be an integer >= 1. "
                             f"Received: backward_passes_per_step={backward_passes_per_step!r}")
        self.prefix = prefix
        self.passes = backward_passes_per_step
        self.average_aggregated = bool(average_aggregated_gradients)
        self._sums: Optional[List[np.ndarray]] = None
        self._count = 0

    def step(self, arrays: Sequence[np.ndarray], keys: Sequence[int]
             ) -> Tuple[bool, Optional[List[np.ndarray]]]:
        """Adds one backward pass; returns ``(True, averaged)`` on update steps.

        Args:
            arrays: This pass's gradients.
            keys: Stable index of each gradient's variable (names and priorities).

        Returns:
            ``(False, None)`` while aggregating, else ``(True, gradients averaged over
            ranks)``.
        """
        if self.passes > 1:
            if self._sums is None:
                self._sums = [np.array(a, copy=True) for a in arrays]
            else:
                self._accumulate(arrays)
            self._count += 1
            if self._count < self.passes:
                return False, None
            arrays, self._sums, self._count = self._sums, None, 0
            if self.average_aggregated:
                arrays = [_group.average(a, self.passes) for a in arrays]
        names = [f"{self.prefix}.{k}" for k in keys]
        return True, _group.push_pull_group(arrays, names, True, [-k for k in keys])

    def _accumulate(self, arrays: Sequence[np.ndarray]) -> None:
        shapes = [a.shape for a in arrays]
        if shapes != [s.shape for s in self._sums]:
            raise ValueError("gradients changed between aggregated backward passes; every "
                             f"pass must produce the same gradients. Received: {shapes}, "
                             f"expected {[s.shape for s in self._sums]}")
        for total, a in zip(self._sums, arrays):
            np.add(total, a, out=total)


def server_optimizer_spec(optimizer) -> str:
    """The servers' optimizer for a Keras SGD or Adam (comm.consistency ssp/async), in
    torch's formulation (param_store.h): the same steps for a constant learning rate;
    Keras's Adam puts epsilon outside the bias correction, so its steps differ slightly.

    Raises:
        ValueError: another optimizer, weight decay, gradient clipping, amsgrad.
    """
    import keras

    cfg = optimizer.get_config()
    bad = [k for k in ("weight_decay", "clipnorm", "clipvalue", "global_clipnorm") if cfg.get(k)]
    if bad:
        raise ValueError("server-held weights (comm.consistency ssp/async) step the optimizer on the "
                         f"servers without {', '.join(bad)}; use comm.consistency=sync for them")
    if isinstance(optimizer, keras.optimizers.SGD):  # (the torch backend subclasses them)
        return f"sgd momentum={float(cfg['momentum'])!r} nesterov={int(bool(cfg['nesterov']))}"
    if isinstance(optimizer, keras.optimizers.Adam) and not cfg.get("amsgrad"):
        return (f"adam beta1={float(cfg['beta_1'])!r} beta2={float(cfg['beta_2'])!r} "
                f"eps={float(cfg['epsilon'])!r}")
    raise ValueError("server-held weights (comm.consistency ssp/async) step keras.optimizers.SGD or Adam "
                     "(no amsgrad) on the servers; use comm.consistency=sync for other optimizers. "
                     f"Received: {type(optimizer).__name__}")


class _DistributedMixin:
    """Placed before the optimizer's class in the MRO; see DistributedOptimizer."""

    _bps_reducer: GradientReducer
    _bps_compression = None
    _bps_server = None  # ServerWeights under comm.consistency ssp/async
    _bps_sparse_as_dense = False

    def apply(self, grads, trainable_variables=None):
        """Averages ``grads`` over all ranks, then applies them (every N-th call); under
        comm.consistency ssp/async takes the servers' weights instead."""
        grads = list(grads)
        if not grads:
            return super().apply(grads, trainable_variables)
        if trainable_variables is None:
            variables = list(getattr(self, "_trainable_variables", []))
        else:
            variables = list(trainable_variables)
            if not self.built:
                import keras

                with keras.name_scope(self.name, caller=self):
                    self.build(variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        keys = [self._bps_key(variables, i) for i in present]
        if self._bps_server is not None:
            return self._bps_apply_server_weights([grads[i] for i in present],
                                                  [variables[i] for i in present], keys)
        compression = self._bps_compression
        if _is_stateful(compression):
            names = [f"{self._bps_reducer.prefix}.{k}" for k in keys]
            # Per-tensor rules match the variables' paths (``dense/kernel``).
            labels = [str(getattr(variables[i], "path", "") or getattr(variables[i], "name", i))
                      if i < len(variables) else str(i) for i in present]
            reduced = compression.reduce([grads[i] for i in present], names, True,
                                         [-k for k in keys], labels)
            for i, value in zip(present, reduced):
                grads[i] = value
            return super().apply(grads, trainable_variables)
        if compression is None and self._bps_reducer.passes == 1 and not self._bps_sparse_as_dense:
            present, keys = self._bps_reduce_row_sparse(grads, present, keys)
        if compression is None:
            sent, contexts = [grads[i] for i in present], [None] * len(present)
        else:
            sent, contexts = zip(*[compression.compress(grads[i]) for i in present])
        update, reduced = _reduce(list(sent), keys, self._bps_reducer)
        for i, value, ctx in zip(present, reduced, contexts):
            grads[i] = value if compression is None else compression.decompress(value, ctx)
        apply = super().apply

        def skip():
            # As Horovod: iterations counts backward passes, also those not applied.
            self._iterations.assign_add(1)

        if update is True:
            return apply(grads, trainable_variables)
        if update is False:
            return skip()
        import keras

        keras.ops.cond(update, lambda: apply(grads, trainable_variables), skip)
        return None

    def _bps_reduce_row_sparse(self, grads, present, keys):
        """Sends the TensorFlow backend's IndexedSlices gradients (embedding lookups) as
        rows (:func:`bpstrain.tensorflow.reduce_indexed_slices`), replacing them in
        ``grads`` by IndexedSlices of the union; returns the positions and keys left for
        the dense path."""
        import keras

        if keras.backend.backend() != "tensorflow":
            return present, keys
        import tensorflow as tf

        from bpstrain.tensorflow._optim import reduce_indexed_slices

        dense = []
        for i, k in zip(present, keys):
            if isinstance(grads[i], tf.IndexedSlices):
                grads[i] = reduce_indexed_slices(grads[i], f"{self._bps_reducer.prefix}.{k}.rows")
            else:
                dense.append((i, k))
        return [i for i, _ in dense], [k for _, k in dense]

    def _bps_apply_server_weights(self, grads, variables, keys):
        """Pushes the gradients, assigns the servers' weights, counts the iteration."""
        import keras

        server = self._bps_server
        lr = self.learning_rate
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            if not tf.executing_eagerly():
                from bpstrain.tensorflow import check_not_xla

                check_not_xla()
                n = len(grads)

                @tf.autograph.experimental.do_not_convert  # plain Python, run by numpy_function
                def run(*arrays):
                    return server.step(arrays[:n], arrays[n:2 * n], keys, float(arrays[-1]))

                tensors = [tf.cast(tf.convert_to_tensor(g), tf.float32) for g in grads]
                values = [tf.cast(v.value, tf.float32) for v in variables]
                outs = tf.numpy_function(run, tensors + values + [tf.cast(lr, tf.float32)],
                                         [tf.float32] * n, stateful=True,
                                         name="bpstrain_server_weights")
                for v, out in zip(variables, outs):
                    v.assign(tf.reshape(tf.cast(out, v.dtype), tf.shape(v.value)))
                self._iterations.assign_add(1)
                return None
        weights = server.step([keras.ops.convert_to_numpy(g) for g in grads],
                              [keras.ops.convert_to_numpy(v.value) for v in variables], keys,
                              float(keras.ops.convert_to_numpy(lr)))
        for v, w in zip(variables, weights):
            v.assign(keras.ops.convert_to_tensor(w, dtype=v.dtype))
        self._iterations.assign_add(1)
        return None

    def _bps_key(self, variables, i: int) -> int:
        # The optimizer's own index of the variable is the same on every rank even when
        # a step passes a subset of the variables; fall back to the position.
        try:
            return int(self._get_variable_index(variables[i]))
        except (AttributeError, IndexError, KeyError):
            return i


def _is_stateful(compression) -> bool:
    # A codec with per-tensor state (bpstrain.tensorflow.Compression.topk(...) etc.)
    # sends the gradients itself; casts go through the reducer.
    return callable(getattr(compression, "reduce", None)) and not isinstance(compression, type)


def _resolve(compression):
    """A spec string or policy as the backend's compressor: any of bpstrain.tensorflow's
    with the TensorFlow backend; with torch only a cast (none, fp16, bf16), as the torch
    backend's gradients go through the reducer's compress/decompress."""
    import keras

    if compression is None:
        return None
    if keras.backend.backend() == "tensorflow":
        from bpstrain.tensorflow.compression import for_optimizer

        return for_optimizer(compression)  # a single codec: tensors of >= 1024 elements
    if isinstance(compression, str):
        from bpstrain.torch.compression import Compression

        casts = {"none": Compression.none, "fp16": Compression.fp16, "bf16": Compression.bf16}
        if compression.strip().lower() not in casts:
            raise ValueError("with the torch Keras backend compression is none, fp16 or bf16 "
                             "(the lossy codecs need per-tensor state this path does not keep: "
                             "use the TensorFlow backend or bpstrain.torch.DistributedOptimizer). "
                             f"Received: compression={compression!r}")
        return casts[compression.strip().lower()]
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise ValueError("with the torch Keras backend compression is a cast with compress() "
                         "and decompress() (bpstrain.torch.Compression.fp16 or bf16). "
                         f"Received: compression={compression!r}")
    return compression


def _check_stateful_backend(compression) -> None:
    import keras

    if _is_stateful(compression) and keras.backend.backend() != "tensorflow":
        raise ValueError("this compressor is written with TensorFlow ops; with the "
                         f"{keras.backend.backend()} backend use that framework's "
                         "Compression (e.g. bpstrain.torch.Compression). Received: "
                         f"compression={compression!r}")


def _reduce(grads, keys, reducer: GradientReducer):
    """Returns ``(update, grads)``; ``update`` is a bool, or a bool tensor in TF graphs."""
    if not grads:
        return True, []
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if not tf.executing_eagerly():
            return _reduce_in_tf_graph(grads, keys, reducer)
    arrays = [keras.ops.convert_to_numpy(g) for g in grads]
    update, reduced = reducer.step(arrays, keys)
    if not update:
        return False, grads
    return True, [keras.ops.convert_to_tensor(r, dtype=g.dtype) for r, g in zip(reduced, grads)]


def _reduce_in_tf_graph(grads, keys, reducer: GradientReducer):
    import tensorflow as tf

    from bpstrain.tensorflow import check_not_xla

    check_not_xla()
    tensors = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices travel dense

    @tf.autograph.experimental.do_not_convert  # plain Python, run by numpy_function
    def run(*arrays):
        update, reduced = reducer.step(arrays, keys)
        return [np.array(update)] + (reduced if update else list(arrays))

    outs = tf.numpy_function(run, tensors, [tf.bool] + [t.dtype for t in tensors],
                             stateful=True, name="bpstrain_push_pull_gradients")
    for out, tensor in zip(outs[1:], tensors):
        out.set_shape(tensor.shape)
    update = True if reducer.passes == 1 else tf.reshape(outs[0], [])
    return update, list(outs[1:])


def DistributedOptimizer(optimizer, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False,
                         name: Optional[str] = None, compression=None,
                         sparse_as_dense: bool = False):
    """Returns a copy of ``optimizer`` that averages gradients over all ranks.

    Example::

        opt = keras.optimizers.SGD(0.01 * bps.size())
        model.compile(optimizer=bps.DistributedOptimizer(opt), loss=...)

    Args:
        optimizer: A Keras 3 optimizer, not built yet (it is rebuilt from its config,
            as in Horovod; a LossScaleOptimizer works and sees averaged gradients).
        backward_passes_per_step: Sum the gradients of this many ``apply`` calls
            locally and communicate once; variables change on every N-th call.
            ``optimizer.iterations`` still counts every call.
        average_aggregated_gradients: Divide that local sum by
            ``backward_passes_per_step`` (default: sum, as in Horovod).
        name: Prefix of the engine names. The default, ``Distributed<Class>.<k>``,
            numbers the wrapped optimizers of this process, so every rank must create
            them in the same order; pass a name when they do not.
        compression: None, or a compressor for the backend's tensors (with the
            TensorFlow backend ``bpstrain.tensorflow.Compression.fp16``, with torch
            ``bpstrain.torch.Compression.fp16``): gradients travel compressed and come
            back in their own dtype. With the TensorFlow backend also the stateful
            codecs (``Compression.onebit()``, ``topk(r)``, ``randomk(r)``,
            ``dithering(s)``, ``powersgd(r)``, ``auto()`` or spec strings), eagerly and
            inside ``model.fit``'s ``tf.function``, for gradients of at least 1024
            elements (``Compression.policy(..., min_size=)`` chooses otherwise); their
            error-feedback state is per rank (``compression.get_state()``/
            ``set_state()``, or a ``tf.train.Checkpoint`` of this optimizer). Not with
            ``backward_passes_per_step > 1`` (the local sum would be kept in the
            compressed dtype).
        sparse_as_dense: With the TensorFlow backend, embedding gradients
            (``tf.IndexedSlices``) travel as rows: only the rows some rank touched, back
            as IndexedSlices of their union, averaged (``bpstrain._sparse``). True sends
            them as dense tensors instead (Horovod's flag); a compression or
            ``backward_passes_per_step > 1`` does so too.

    Under ``comm.consistency`` ``ssp:<s>`` or ``async`` (set before wrapping) the servers
    hold the variables, seeded from rank 0's at the first step, and apply SGD (momentum,
    Nesterov) or Adam themselves; each step pushes the gradients and assigns the
    weights that come back (see :func:`server_optimizer_spec`).

    Raises:
        ValueError: ``optimizer`` is not a Keras optimizer, or is already distributed,
            or ``compression`` is combined with ``backward_passes_per_step > 1``.
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError("DistributedOptimizer wraps a keras.optimizers.Optimizer. "
                         f"Received: {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError(f"the optimizer is already distributed. Received: {optimizer!r}")
    if optimizer.built:
        import warnings

        warnings.warn("DistributedOptimizer rebuilds the optimizer from its config; the state "
                      "of the built one (slots, iterations) is not carried over. Wrap it "
                      "before use. Received: a built optimizer", stacklevel=2)
    if compression is not None and backward_passes_per_step != 1:
        raise ValueError("compression cannot be combined with backward_passes_per_step > 1 "
                         "(the local sum would be kept in the compressed dtype); aggregate "
                         "uncompressed. Received: compression="
                         f"{compression!r}, backward_passes_per_step={backward_passes_per_step}")
    compression = _resolve(compression)
    _check_stateful_backend(compression)
    check_optimizer_momentum(compression, getattr(optimizer, "momentum", None),
                             bool(getattr(optimizer, "nesterov", False)))
    base = type(optimizer)
    reducer = GradientReducer(name or f"Distributed{base.__name__}.{next(_instances)}",
                              backward_passes_per_step,
                              average_aggregated_gradients)
    # Same name and module as the original: saved models refer to the plain class.
    cls = type(base.__name__, (_DistributedMixin, base),
               {"__module__": base.__module__, "__qualname__": base.__qualname__})
    wrapped = cls.from_config(optimizer.get_config())
    wrapped._bps_reducer = reducer
    wrapped._bps_compression = compression
    wrapped._bps_sparse_as_dense = bool(sparse_as_dense)
    from bpstrain import _server_weights

    if _server_weights.consistency() != "sync":
        if compression is not None or backward_passes_per_step != 1:
            raise ValueError("comm.consistency ssp/async pushes every step's gradients uncompressed; "
                             "drop compression and backward_passes_per_step, or use sync")
        wrapped._bps_server = _server_weights.ServerWeights(reducer.prefix, server_optimizer_spec(optimizer))
    return wrapped
