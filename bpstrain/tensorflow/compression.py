"""Gradient compression around push_pull for TensorFlow (Horovod/BytePS ``Compression``).

The same names and semantics as :mod:`bpstrain.torch.compression`, written with
TensorFlow ops. Every compressor is taken by ``push_pull``, ``DistributedGradientTape``,
``DistributedOptimizer`` and the Keras ``DistributedOptimizer``:

* **Casts** (``Compression.none``, ``Compression.fp16``, ``Compression.bf16``): the
  Horovod interface, ``compress`` returns the tensor to send and a context,
  ``decompress`` undoes it.

    >>> import tensorflow as tf
    >>> small, ctx = Compression.fp16.compress(tf.ones(3))
    >>> small.dtype, Compression.fp16.decompress(small, ctx).dtype
    (tf.float16, tf.float32)

* **Stateful codecs** (``Compression.onebit(scaling=True)``, ``topk(ratio)``,
  ``randomk(ratio)``, ``dithering(levels)``, ``powersgd(rank)``): instances that keep,
  per tensor name, an error-feedback residual (what compression dropped, added to the
  next step's gradient; on by default) and move whole groups with
  :meth:`StatefulCompressor.reduce`. onebit, top-k and dithering travel as the blobs of
  :mod:`bpstrain._codec` (engine dtype ``"compressed"``: the servers decode, sum, keep
  their own residual and answer compressed, and the result is divided by the number
  of ranks to average); random-k sends the values at indices every rank derives from a
  shared seed, PowerSGD its two low-rank factors P and Q (plain float32 that the
  servers sum). Encoding runs on the tensor's device, eagerly and inside
  ``tf.function`` (not under XLA).
* **Choosers**: ``Compression.auto(...)`` (compress a tensor only where it saves more
  wire time than it costs; eager only) and ``Compression.policy(default, rules,
  min_size)`` (per-tensor specs by name pattern and size, as the Trainer's
  ``comm.compression_rules``). :func:`from_spec` reads spec strings (``"topk:0.01"``,
  see :func:`bpstrain._compression.parse_compression`).

State (residuals, PowerSGD's Q, random-k's step) belongs to the rank: save it with
``compression.get_state()`` and restore it with ``set_state`` (or with
``tf.train.Checkpoint(compression=c)``: the stateful compressors are ``tf.Module`` objects).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from bpstrain import _group
from bpstrain._compression import (AutoPolicy, CompressionPolicy, CompressionSpec, Compressor,
                                   HalfCompressor, NoneCompressor, parse_compression,
                                   parse_policy, wire_bytes)
from bpstrain.tensorflow import _wire
from bpstrain.tensorflow._stateful import (DitheringCompressor, OneBitCompressor,
                                           PowerSGDCompressor, RandomKCompressor,
                                           StatefulCompressor, TopKCompressor)

__all__ = ["AutoCompressor", "BF16Compressor", "Compression", "Compressor",
           "DitheringCompressor", "FP16Compressor", "NoneCompressor", "OneBitCompressor",
           "PolicyCompressor", "PowerSGDCompressor", "RandomKCompressor", "StatefulCompressor",
           "TopKCompressor", "check_compression", "for_optimizer", "for_push_pull", "from_spec",
           "is_stateful", "reduce_with", "resolve"]


class _TFHalf(HalfCompressor):
    """The TensorFlow hooks of a casting compressor."""

    @staticmethod
    def _prepare(tensor):
        return tf.convert_to_tensor(tensor)

    @staticmethod
    def _dtype(tensor):
        return tensor.dtype

    @staticmethod
    def _is_floating(dtype):
        return dtype.is_floating

    @staticmethod
    def _cast(tensor, dtype):
        return tf.cast(tensor, dtype)


class FP16Compressor(_TFHalf):
    """Sends floating-point tensors as float16 (half the bytes); others unchanged."""

    _half = tf.float16


class BF16Compressor(_TFHalf):
    """Sends floating-point tensors as bfloat16 (float32's range, half the bytes)."""

    _half = tf.bfloat16


def from_spec(spec: Any):
    """The compressor of a spec (``"topk:0.01"``, a dict or a ``CompressionSpec``).

    Casts come back as their classes, the rest as new instances.

    Raises:
        ValueError: the spec does not parse (the message names what is accepted).
    """
    spec = parse_compression(spec)
    c = spec.codec
    if c == "none":
        return NoneCompressor
    if c in ("fp16", "bf16"):
        return FP16Compressor if c == "fp16" else BF16Compressor
    ef = spec.ef
    blob = dict(error_feedback=ef, server_error_feedback=spec.server_error_feedback,
                chunk=spec.chunk)
    if c == "onebit":
        return OneBitCompressor(spec.scaled, **blob)
    if c == "topk":
        return TopKCompressor(spec.ratio, **blob)
    if c == "dithering":
        return DitheringCompressor(spec.levels, spec.stochastic, spec.seed or None, **blob)
    if c == "randomk":
        return RandomKCompressor(spec.ratio, spec.seed, ef)
    if c == "powersgd":
        return PowerSGDCompressor(spec.rank, spec.seed, ef)
    return AutoCompressor(spec.inner, spec.steps, spec.bandwidth)


class AutoCompressor(tf.Module):
    """Compresses a tensor only where that saves more wire time than it costs.

    The first steps of each tensor measure (one uncompressed push_pull to price the
    link when the engine reports no bandwidth, then ``steps`` compressed ones timing
    the codec); then every rank takes the same sticky decision
    (:class:`bpstrain._compression.AutoPolicy`). Decisions are taken in Python per step,
    so it runs eagerly only (``model.compile(run_eagerly=True)`` with Keras).

    Args:
        compression: The spec it switches on or off (default fp16).
        steps: Compressed steps measured before deciding.
        bandwidth: Link bytes/s used to price saved bytes (None: the engine's, else
            measured).
    """

    def __init__(self, compression: Any = "fp16", steps: int = 5,
                 bandwidth: Optional[float] = None):
        super().__init__()
        self.inner_spec: CompressionSpec = parse_compression(compression or "fp16")
        if self.inner_spec.codec in ("auto", "none"):
            raise ValueError("auto wraps a compressing codec. "
                             f"Received: compression={compression!r}")
        self.inner = from_spec(self.inner_spec)
        self.steps, self.bandwidth = int(steps), bandwidth
        self.policy = AutoPolicy(steps, bandwidth)

    @property
    def spec(self) -> CompressionSpec:
        """The spec this compressor implements (``auto:...``)."""
        return parse_compression({"codec": "auto", "inner": self.inner_spec, "steps": self.steps,
                                  **({"bandwidth": self.bandwidth} if self.bandwidth else {})})

    def reduce(self, tensors: Sequence, names: Sequence[str], average: bool = True,
               priorities: Optional[Sequence[int]] = None,
               labels: Optional[Sequence[str]] = None) -> List[tf.Tensor]:
        """Like :meth:`StatefulCompressor.reduce`, choosing per tensor (eagerly).

        Raises:
            RuntimeError: inside a ``tf.function``.
        """
        if not tf.executing_eagerly():
            raise RuntimeError(
                "Compression.auto decides per step in Python and runs eagerly only; use "
                "model.compile(run_eagerly=True) (Keras) or call it outside tf.function, "
                "or pick a codec (e.g. Compression.fp16). Received: a tf.function trace")
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        priorities = _group._priorities(priorities, len(tensors))  # default -index
        out: List[Optional[tf.Tensor]] = [None] * len(tensors)
        compressed, plain = [], []
        for i, (t, name) in enumerate(zip(tensors, names)):
            phase = self.policy.phase(name, name) if t.dtype.is_floating else "off"
            if phase == "raw":  # alone, so that its time is its own
                start = time.perf_counter()
                out[i] = reduce_with(NoneCompressor, [t], [name], average, [priorities[i]])[0]
                self.policy.record_raw(name, time.perf_counter() - start,
                                       t.dtype.size * _wire.numel(t.shape))
            elif phase in ("off", "compare"):
                plain.append(i)
            else:
                if phase == "measure":
                    self._measure(t, name)
                compressed.append(i)
        for group, compression in ((compressed, self.inner), (plain, NoneCompressor)):
            if group:
                values = reduce_with(compression, [tensors[i] for i in group],
                                     [names[i] for i in group], average,
                                     [priorities[i] for i in group])
                for i, value in zip(group, values):
                    out[i] = value
        return out

    def _measure(self, tensor: tf.Tensor, name: str) -> None:
        numel = _wire.numel(tensor.shape)
        start = time.perf_counter()
        if is_stateful(self.inner):
            back = self.inner.roundtrip(tensor)
        else:
            sent, ctx = self.inner.compress(tensor)
            back = self.inner.decompress(sent, ctx)
        np.asarray(tf.reduce_sum(back))  # waits for a GPU's kernels
        self.policy.record_codec(name, time.perf_counter() - start, tensor.dtype.size * numel,
                                 wire_bytes(self.inner_spec, numel, tensor.dtype.size))

    def get_state(self, server_state: bool = False) -> Dict[str, Any]:
        """The decisions and measurements, and the inner codec's state (see
        :meth:`StatefulCompressor.get_state`)."""
        inner = self.inner.get_state(server_state) if is_stateful(self.inner) else {}
        return {"auto": self.policy.state_dict(), **{f"inner/{k}": v for k, v in inner.items()}}

    def set_state(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`get_state`'s output."""
        self.policy.load_state_dict(state.get("auto", {}))
        inner = {k[len("inner/"):]: v for k, v in state.items() if k.startswith("inner/")}
        if inner and is_stateful(self.inner):
            self.inner.set_state(inner)


class PolicyCompressor(tf.Module):
    """Per-tensor compression: each tensor gets the spec its name and size select.

    Tensors are grouped by spec and each group is push_pulled by that spec's compressor
    (one instance per spec, keeping its own state).

    Args:
        policy: A :class:`bpstrain._compression.CompressionPolicy`.
        default: The compressor of the policy's default spec (e.g. one the user holds,
            so that its ``get_state`` sees the state); made from the spec otherwise.
    """

    def __init__(self, policy: CompressionPolicy, default: Any = None):
        super().__init__()
        self.policy = policy
        self.compressors: Dict[str, Any] = {}  # spec string -> stateful compressor
        if default is not None:
            self.compressors[str(policy.default)] = default

    def _for(self, spec: CompressionSpec):
        key = str(spec)
        if key in self.compressors:
            return self.compressors[key]
        compressor = from_spec(spec)
        if is_stateful(compressor):
            self.compressors[key] = compressor
        return compressor

    def reduce(self, tensors: Sequence, names: Sequence[str], average: bool = True,
               priorities: Optional[Sequence[int]] = None,
               labels: Optional[Sequence[str]] = None) -> List[tf.Tensor]:
        """Like :meth:`StatefulCompressor.reduce`, one group per spec chosen by ``labels``
        (default ``names``) and size."""
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        priorities = _group._priorities(priorities, len(tensors))  # default -index
        groups: Dict[str, List[int]] = {}
        specs: Dict[str, CompressionSpec] = {}
        for i, (t, label) in enumerate(zip(tensors, labels or names)):
            numel = _wire.numel(t.shape) if t.shape.is_fully_defined() else 0
            spec = self.policy.spec_for(label, numel)
            groups.setdefault(str(spec), []).append(i)
            specs[str(spec)] = spec
        out: List[Optional[tf.Tensor]] = [None] * len(tensors)
        for key, group in groups.items():
            values = reduce_with(self._for(specs[key]), [tensors[i] for i in group],
                                 [names[i] for i in group], average,
                                 [priorities[i] for i in group])
            for i, value in zip(group, values):
                out[i] = value
        return out

    def get_state(self, server_state: bool = False) -> Dict[str, Any]:
        """Every spec's compressor state, keys ``<spec>|<key>`` (see
        :meth:`StatefulCompressor.get_state`)."""
        return {f"{spec}|{k}": v for spec, c in sorted(self.compressors.items())
                for k, v in c.get_state(server_state).items()}

    def set_state(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`get_state`'s output."""
        by_spec: Dict[str, Dict[str, Any]] = {}
        for key, value in state.items():
            spec, inner = key.split("|", 1)
            by_spec.setdefault(spec, {})[inner] = value
        for spec, inner in sorted(by_spec.items()):  # the same order on every rank
            compressor = self._for(parse_compression(spec))
            if is_stateful(compressor):
                compressor.set_state(inner)


class Compression:
    """The available compressors (Horovod's names, BytePS's codecs).

    ``none``, ``fp16`` and ``bf16`` are stateless casts; the others are factories of
    stateful instances: use one per optimizer (it keeps state per tensor name).
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def onebit(scaling: bool = True, **kwargs) -> OneBitCompressor:
        """1 bit per element plus a magnitude per chunk; see :class:`OneBitCompressor`."""
        return OneBitCompressor(scaling, **kwargs)

    @staticmethod
    def topk(ratio: float, **kwargs) -> TopKCompressor:
        """The largest ``ratio`` of each chunk; see :class:`TopKCompressor`."""
        return TopKCompressor(ratio, **kwargs)

    @staticmethod
    def randomk(ratio: float, **kwargs) -> RandomKCompressor:
        """A shared random ``ratio`` of the elements; see :class:`RandomKCompressor`."""
        return RandomKCompressor(ratio, **kwargs)

    @staticmethod
    def dithering(levels: int, **kwargs) -> DitheringCompressor:
        """int8 levels of each chunk's max |x|; see :class:`DitheringCompressor`."""
        return DitheringCompressor(levels, **kwargs)

    @staticmethod
    def powersgd(rank: int, **kwargs) -> PowerSGDCompressor:
        """Rank-``rank`` factors P and Q; see :class:`PowerSGDCompressor`."""
        return PowerSGDCompressor(rank, **kwargs)

    @staticmethod
    def auto(compression: Any = "fp16", steps: int = 5,
             bandwidth: Optional[float] = None) -> AutoCompressor:
        """``compression`` where it pays, per tensor; see :class:`AutoCompressor`."""
        return AutoCompressor(compression, steps, bandwidth)

    @staticmethod
    def from_spec(spec: Any):
        """The compressor of a spec string, dict or CompressionSpec (``"topk:0.01"``)."""
        return from_spec(spec)

    @staticmethod
    def policy(default: Any = "none", rules: Sequence[Any] = (),
               min_size: Optional[int] = None) -> PolicyCompressor:
        """Per-tensor specs: ``rules`` (``{"pattern", "compression", "min_size"}``, first
        match wins), else ``default``; nothing below ``min_size`` elements (default 1024)."""
        return PolicyCompressor(parse_policy(default, rules, min_size))


def resolve(compression):
    """``compression`` as a compressor: a spec (string, dict or ``CompressionSpec``) or a
    ``CompressionPolicy`` is built (:func:`from_spec`, :class:`PolicyCompressor`);
    compressors pass as they are."""
    if isinstance(compression, CompressionPolicy):
        return PolicyCompressor(compression)
    if isinstance(compression, (str, dict, CompressionSpec)):
        return from_spec(compression)
    return compression


def for_optimizer(compression):
    """What DistributedOptimizer and DistributedGradientTape use for ``compression``: as
    torch's, a single codec (or ``auto``) applies per tensor, tensors under
    :data:`~bpstrain._compression.DEFAULT_MIN_SIZE` elements (1024) stay uncompressed; the
    codec object is kept (its ``get_state`` sees the state). Use ``Compression.policy``
    for another minimum size; casts and policies pass as they are."""
    compression = resolve(compression)
    if isinstance(compression, (StatefulCompressor, AutoCompressor)):
        return PolicyCompressor(CompressionPolicy(compression.spec), default=compression)
    return compression


def for_push_pull(compression):
    """What ``push_pull`` uses: a spec string of a stateful codec is refused, as torch's
    push_pull does (a compressor made per call would forget its residual)."""
    made = resolve(compression)
    if made is not compression and is_stateful(made):
        raise ValueError("push_pull takes a stateful compressor as an object: make it once "
                         "(e.g. comp = Compression.topk(0.01)) and pass it at every call, so "
                         "that it keeps the tensor's residual. Received: "
                         f"compression={compression!r}")
    return made


def is_stateful(compression) -> bool:
    """True for compressors that move tensors themselves (a ``reduce`` method)."""
    return callable(getattr(compression, "reduce", None)) and not isinstance(compression, type)


def check_compression(compression) -> None:
    """Raises ValueError unless ``compression`` is a cast (``compress``/``decompress``) or a
    compressor that moves tensors itself (``reduce``)."""
    if is_stateful(compression):
        return
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise ValueError("compression must be one of bpstrain.tensorflow.Compression's (none, "
                         "fp16, bf16, onebit(), topk(r), randomk(r), dithering(s), powersgd(r), "
                         "auto(), policy()) or an object with compress() and decompress(). "
                         f"Received: compression={compression!r}")


def reduce_with(compression, tensors: Sequence, names: Sequence[str], average: bool = True,
                priorities: Optional[Sequence[int]] = None,
                labels: Optional[Sequence[str]] = None) -> List[tf.Tensor]:
    """push_pulls ``tensors`` as one group through ``compression`` (any kind): the one
    funnel of push_pull, DistributedGradientTape and the optimizers. ``labels``: what
    per-tensor rules match (default ``names``)."""
    if is_stateful(compression):
        return compression.reduce(tensors, names, average, priorities, labels)
    sent = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    from bpstrain.tensorflow import _ops  # (imports this module)

    reduced = _ops.run_group("push_pull", [t for t, _ in sent], names, average,
                             priorities=priorities)
    return [compression.decompress(value, ctx) for value, (_, ctx) in zip(reduced, sent)]
