"""The stateful TensorFlow codecs (onebit, top-k, dithering, random-k, PowerSGD) and their
per-tensor state; the public names are re-exported by :mod:`bpstrain.tensorflow.compression`."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from bpstrain import _codec, _group, engine
from bpstrain._compression import CompressionSpec, parse_compression, powersgd_initial_q
from bpstrain.tensorflow import _wire


class StatefulCompressor(tf.Module):
    """Base of the codecs that keep per-tensor state; see the module docstring.

    Subclasses implement :meth:`_reduce` for the tensors they compress; the others
    (integers, tensors without a full static shape, ones the codec does not shrink)
    travel plain.

    Args:
        error_feedback: Keep what compression dropped and add it to the next step's
            gradient of the same name (on by default, as every lossy codec needs).
    """

    codec_name = ""  # its name in spec strings

    def __init__(self, error_feedback: bool = True, name: Optional[str] = None):
        super().__init__(name=name)
        self.error_feedback = bool(error_feedback)
        self._state: Dict[str, tf.Variable] = {}
        self._pending: Dict[str, np.ndarray] = {}

    # -- the interface used by push_pull and the optimizers --------------------------------

    def reduce(self, tensors: Sequence, names: Sequence[str], average: bool = True,
               priorities: Optional[Sequence[int]] = None,
               labels: Optional[Sequence[str]] = None) -> List[tf.Tensor]:
        """push_pulls ``tensors`` compressed, as one group; returns them summed or averaged.

        Args:
            tensors: Tensors (IndexedSlices are made dense).
            names: Engine names, the same on every rank; they also key the state.
            average: Average (default) or sum over ranks.
            priorities: Larger is sent sooner; default ``-index``.
            labels: What per-tensor rules match (:class:`PolicyCompressor`), e.g. the
                variables' paths; default ``names``. Ignored by a single codec.

        Returns:
            Tensors of the inputs' dtypes and shapes.
        """
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        priorities = _group._priorities(priorities, len(tensors))  # default -index
        accepted = [self._accepts(t) for t in tensors]
        mine = [i for i, ok in enumerate(accepted) if ok]
        plain = [i for i, ok in enumerate(accepted) if not ok]
        # The plain ones ride in the same engine group as the compressed ones.
        extra = [_wire.Item(tensors[i], names[i], average, 0, priorities[i]) for i in plain]
        results, plain_out = self._reduce([tensors[i] for i in mine], [names[i] for i in mine],
                                          average, [priorities[i] for i in mine], extra)
        out: List[Optional[tf.Tensor]] = [None] * len(tensors)
        for i, value in zip(mine, results):
            out[i] = tf.cast(tf.reshape(value, tensors[i].shape), tensors[i].dtype)
        for i, value in zip(plain, plain_out):
            out[i] = value
        return out

    def compress(self, tensor):
        """Not available: a stateful codec moves whole groups with :meth:`reduce`."""
        raise TypeError(f"{type(self).__name__} sends tensors itself; call "
                        "compression.reduce(tensors, names) (push_pull and the optimizers do). "
                        f"Received: compress({type(tensor).__name__})")

    decompress = compress

    def get_state(self, server_state: bool = False) -> Dict[str, np.ndarray]:
        """This rank's state as ``{key: array}`` (keys ``residual/<name>`` etc.).

        Args:
            server_state: Also fetch the servers' residuals of the onebit/top-k/dithering
                tensors (keys ``server/<name>``), so that a restored job answers what
                this one would have. **Collective**: every rank calls it at the same
                point; costs about one dense fp32 copy of those tensors on the wire.
        """
        state = {key: v.numpy() for key, v in self._state.items()}
        return {**self._pending, **state, **(self._server_state() if server_state else {})}

    def set_state(self, state: Dict[str, np.ndarray]) -> None:
        """Restores :meth:`get_state`'s output; state of tensors not seen yet is kept
        until their first step. ``server/<name>`` entries go back to the servers at once
        (then the call is collective, as ``get_state(server_state=True)``)."""
        for key in sorted(state):  # the same order on every rank
            value = state[key]
            if key.startswith("server/"):
                self._import_server_state(key[len("server/"):], np.asarray(value))
            elif key in self._state:
                self._state[key].assign(np.asarray(value))
            else:
                self._pending[key] = np.asarray(value)

    @property
    def spec(self) -> CompressionSpec:
        """The spec this compressor implements (``str(spec)`` parses back to it)."""
        return parse_compression({"codec": self.codec_name, **self._options()})

    def _options(self) -> dict:
        return {"error_feedback": self.error_feedback}

    def roundtrip(self, tensor) -> tf.Tensor:
        """This rank's tensor compressed and decompressed locally, state untouched (what
        ``auto`` times). Tensors the codec does not take come back as they are."""
        tensor = tf.convert_to_tensor(tensor)
        if not self._accepts(tensor):
            return tensor
        flat = tf.reshape(tf.cast(tensor, tf.float32), [-1])
        return tf.cast(tf.reshape(self._roundtrip(flat, tensor.shape), tensor.shape), tensor.dtype)

    # -- for subclasses ----------------------------------------------------------------------

    def _roundtrip(self, flat: tf.Tensor, shape) -> tf.Tensor:
        raise NotImplementedError

    def _server_state(self) -> Dict[str, np.ndarray]:
        return {}  # the servers sum plain values: they keep nothing

    def _import_server_state(self, name: str, residual: np.ndarray) -> None:
        raise ValueError(f"{type(self).__name__} keeps no server state. "
                         f"Received: server/{name}")

    def _accepts(self, tensor: tf.Tensor) -> bool:
        return (tensor.dtype.is_floating and tensor.shape.is_fully_defined()
                and _wire.numel(tensor.shape) > 0)

    def _reduce(self, tensors, names, average, priorities, extra):
        """Returns (results of ``tensors``, results of the plain ``extra`` items)."""
        raise NotImplementedError

    def _variable(self, key: str, initial, dtype=tf.float32) -> tf.Variable:
        """The state variable ``key``, created outside any tf.function on first use."""
        if key not in self._state:
            value = self._pending.pop(key, None)
            with tf.init_scope():  # lifted out of tf.function: created once, eagerly
                init = initial() if value is None else value
                self._state[key] = tf.Variable(init, dtype=dtype, trainable=False,
                                               name=key.replace("/", "_").replace(":", "_"))
        return self._state[key]

    def _with_residual(self, name: str, flat: tf.Tensor):
        if not self.error_feedback:
            return flat, None
        residual = self._variable(f"residual/{name}", lambda: tf.zeros(flat.shape, tf.float32))
        return flat + residual, residual

    momentum = 0.0  # top-k: DGC's momentum correction when set

    def _with_velocity(self, name: str, flat: tf.Tensor):
        """DGC's momentum correction, worker side: ``(u, variable)`` with the velocity
        u = m*u + flat that error feedback then accumulates, or ``(flat, None)`` when off."""
        if not self.momentum:
            return flat, None
        velocity = self._variable(f"velocity/{name}", lambda: tf.zeros(flat.shape, tf.float32))
        return self.momentum * velocity + flat, velocity

    def _as_momentum_gradient(self, name: str, out: tf.Tensor) -> tf.Tensor:
        """The sent sum S_t handed to an SGD with momentum m: S_t - m*S_{t-1}, so that its
        buffer, and so its update, is S_t (as torch's). A non-finite step is not kept."""
        if not self.momentum:
            return out
        before = self._variable(f"applied/{name}", lambda: tf.zeros(out.shape, tf.float32))
        result = out - self.momentum * before
        _keep_finite(before, out, out)
        return result

    def _check_options(self) -> None:
        """Raises what the spec parser says of bad options (e.g. momentum without error feedback)."""
        parse_compression({"codec": self.codec_name, **self._options()})


class _BlobCompressor(StatefulCompressor):
    """onebit, top-k and dithering: blobs of :mod:`bpstrain._codec`, decoded after the pull.

    Args:
        error_feedback: The workers' residual.
        server_error_feedback: Ask the servers to keep a residual of their re-encoded sum.
        chunk: Elements per blob (``bpstrain._codec.DEFAULT_CHUNK``, 4 MB of float32).
    """

    codec = 0
    stochastic = False

    def __init__(self, error_feedback: bool = True, server_error_feedback: bool = True,
                 chunk: int = _codec.DEFAULT_CHUNK, name: Optional[str] = None):
        super().__init__(error_feedback, name)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1. Received: chunk={chunk!r}")
        self.server_error_feedback = bool(server_error_feedback)
        self.chunk = chunk
        self._sizes: Dict[str, int] = {}  # name -> elements, for the servers' state

    def _template(self, numel: int):
        """A byte string of the tensor's layout (state rounds copy its headers) and its
        partition bytes."""
        layout = self.layout(numel)
        return _wire.encode(layout, tf.zeros([numel])).numpy().tobytes(), layout.partition_bytes

    def _server_state(self):
        if not self.server_error_feedback:
            return {}
        from bpstrain import _server_state

        return {f"server/{name}": _server_state.export_residual(name, *self._template(numel))
                for name, numel in sorted(self._sizes.items())}

    def _import_server_state(self, name, residual):
        from bpstrain import _server_state

        self._sizes[name] = int(residual.size)
        _server_state.import_residual(name, *self._template(int(residual.size)), residual)

    def layout(self, numel: int) -> _wire.Layout:
        """The blobs of a flat tensor of ``numel`` elements."""
        raise NotImplementedError

    def _options(self):
        return {**super()._options(), "server_error_feedback": self.server_error_feedback,
                "chunk": self.chunk}

    def _uniform(self, n: int) -> tf.Tensor:
        raise NotImplementedError  # stochastic codecs only

    def _reduce(self, tensors, names, average, priorities, extra):
        items, layouts, finite = [], [], []
        for x, name, priority in zip(tensors, names, priorities):
            moving, velocity = self._with_velocity(name, tf.reshape(tf.cast(x, tf.float32), [-1]))
            flat, residual = self._with_residual(name, moving)
            layout = self.layout(int(flat.shape[0]))
            self._sizes[name] = int(flat.shape[0])
            finite.append(tf.reduce_all(tf.math.is_finite(flat)))
            if self.server_error_feedback:
                # An inf/NaN blob would leave the servers' residual NaN for good (they add
                # it to every later sum): send zeros, and say so in the overflow flag.
                flat = tf.where(finite[-1], flat, tf.zeros_like(flat))
            blob = _wire.encode(layout, flat, self._uniform if self.stochastic else None)
            if residual is not None:
                left = flat - _wire.decode(layout, blob)
                _keep_finite(residual, left, finite[-1])
                if velocity is not None:  # top-k sends exact values: nothing is left where it sent
                    _keep_finite(velocity, tf.where(tf.equal(left, 0), tf.zeros_like(moving), moving),
                                 finite[-1])
            items.append(_wire.Item(blob, name, False, layout.partition_bytes, priority))
            layouts.append(layout)
        flag = []
        if items and self.server_error_feedback:
            # One float per group: how many ranks overflowed, so that every rank returns a
            # non-finite result for the step (a LossScaleOptimizer then skips it on all).
            bad = tf.cast(tf.logical_not(tf.reduce_all(tf.stack(finite))), tf.float32)
            flag = [_wire.Item(tf.reshape(bad, [1]), f"{names[0]}.overflow", False, 0,
                               max(priorities))]
        outs = _wire.transfer(items + flag + extra)
        size = float(engine.size())
        results = [_wire.decode(layout, out) / (size if average else 1.0)
                   for layout, out in zip(layouts, outs)]
        if flag:
            overflow = outs[len(items)][0] > 0
            results = [tf.where(overflow, tf.fill(tf.shape(r), np.float32(np.nan)), r)
                       for r in results]
        results = [self._as_momentum_gradient(name, r) for name, r in zip(names, results)]
        return results, outs[len(items) + len(flag):]

    def _roundtrip(self, flat, shape):
        layout = self.layout(int(flat.shape[0]))
        return _wire.decode(layout, _wire.encode(layout, flat))


class OneBitCompressor(_BlobCompressor):
    """Sends the sign of every element (1 bit) and one magnitude per chunk.

    Args:
        scaling: The magnitude is the chunk's mean absolute value (else 1).
        error_feedback, server_error_feedback: Residuals on the workers / servers.
        chunk: Elements per blob (one scale each).
    """

    codec, codec_name = _codec.ONEBIT, "onebit"

    def __init__(self, scaling: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.scaling = bool(scaling)

    def _options(self):
        return {**super()._options(), "scaled": self.scaling}

    def layout(self, numel):
        return _wire.Layout(self.codec, numel, self.chunk, scaled=self.scaling,
                            server_ef=self.server_error_feedback)


class TopKCompressor(_BlobCompressor):
    """Sends the ``ceil(ratio * n)`` largest-magnitude elements of each chunk.

    Args:
        ratio: Share of elements sent, in (0, 1].
    """

    codec, codec_name = _codec.TOPK, "topk"

    def __init__(self, ratio: float, momentum: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.ratio, self.momentum = _ratio("topk", ratio), float(momentum)
        self._check_options()

    def _options(self):
        return {**super()._options(), "ratio": self.ratio, "momentum": self.momentum}

    def layout(self, numel):
        return _wire.Layout(self.codec, numel, self.chunk, ratio=self.ratio,
                            server_ef=self.server_error_feedback)


class DitheringCompressor(_BlobCompressor):
    """Sends each element as one of ``2 * levels + 1`` levels of the chunk's max |x|.

    Args:
        levels: Levels per sign, 1..127 (one int8 per element).
        stochastic: Round stochastically on the workers (unbiased); else to the nearest.
    """

    codec, codec_name = _codec.DITHERING, "dithering"

    def __init__(self, levels: int, stochastic: bool = True, seed: Optional[int] = None,
                 **kwargs):
        super().__init__(**kwargs)
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError("dithering needs an integer number of levels in [1, 127]. "
                             f"Received: levels={levels!r}")
        self.levels, self.stochastic, self.seed = levels, bool(stochastic), seed
        # Rounding needs no agreement between ranks; a seed makes a run repeatable.
        self.generator = (tf.random.Generator.from_non_deterministic_state() if seed is None
                          else tf.random.Generator.from_seed(int(seed)))

    def _uniform(self, n: int) -> tf.Tensor:
        return self.generator.uniform([n], dtype=tf.float64)

    def _options(self):
        return {**super()._options(), "levels": self.levels, "stochastic": self.stochastic,
                "seed": self.seed or 0}

    def layout(self, numel):
        return _wire.Layout(self.codec, numel, self.chunk, levels=self.levels,
                            server_ef=self.server_error_feedback)


class RandomKCompressor(StatefulCompressor):
    """Sends ``ceil(ratio * n)`` elements at indices every rank draws alike.

    The indices come from :func:`bpstrain._codec.randomk_indices` (seed, tensor name,
    step), so only the values travel, as float32 that the servers sum.

    Args:
        ratio: Share of elements sent, in (0, 1].
        seed: Shared by every rank.
    """

    def __init__(self, ratio: float, seed: int = 0, error_feedback: bool = True,
                 name: Optional[str] = None):
        super().__init__(error_feedback, name)
        self.ratio, self.seed = _ratio("randomk", ratio), int(seed)

    codec_name = "randomk"

    def _options(self):
        return {**super()._options(), "ratio": self.ratio, "seed": self.seed}

    def indices(self, name: str, n: int, k: int) -> tf.Tensor:
        """This step's ``k`` indices of tensor ``name`` (advances its step counter)."""
        step = self._variable(f"step/{name}", lambda: 0, tf.int64)
        seed = self.seed

        @tf.autograph.experimental.do_not_convert
        def affine(at):
            return np.array(_codec.randomk_affine(n, seed, name, int(at)), np.int64)

        if tf.executing_eagerly():
            ab = tf.constant(affine(step.numpy()))
        else:
            ab = tf.reshape(tf.numpy_function(affine, [step], tf.int64, stateful=False), [2])
        step.assign_add(1)
        return (ab[0] + tf.range(k, dtype=tf.int64) * ab[1]) % n

    def _roundtrip(self, flat, shape):
        n = int(flat.shape[0])
        a, b = _codec.randomk_affine(n, self.seed, "auto", 0)
        idx = ((a + tf.range(_codec.topk_count(n, self.ratio), dtype=tf.int64) * b) % n)[:, None]
        return tf.scatter_nd(idx, tf.gather_nd(flat, idx), [n])

    def _reduce(self, tensors, names, average, priorities, extra):
        items, picks = [], []
        for x, name, priority in zip(tensors, names, priorities):
            flat, residual = self._with_residual(name, tf.reshape(tf.cast(x, tf.float32), [-1]))
            n = int(flat.shape[0])
            idx = self.indices(name, n, _codec.topk_count(n, self.ratio))[:, None]
            values = tf.gather_nd(flat, idx)
            if residual is not None:
                _keep_finite(residual, flat - tf.scatter_nd(idx, values, [n]), flat)
            items.append(_wire.Item(values, name, average, 0, priority))
            picks.append((idx, n))
        outs = _wire.transfer(items + extra)
        return [tf.scatter_nd(idx, out, [n]) for (idx, n), out in zip(picks, outs)], \
            outs[len(items):]


class PowerSGDCompressor(StatefulCompressor):
    """Rank-``rank`` PowerSGD adapted to the parameter servers: two push_pull rounds.

    A gradient reshaped to an ``n x m`` matrix M (first dimension by the rest) is sent
    as ``P = M Q`` (``n x rank``), averaged by the servers (P is linear in M because
    every rank shares Q), orthogonalised, then ``Q = M^T P`` (``m x rank``), averaged;
    the result is ``P Q^T``. Q is kept for the next step (warm start); it starts from a
    normal draw seeded by ``seed`` and the tensor name, alike on every rank. Tensors of
    one dimension, or where the factors would not be smaller, travel plain.

    Args:
        rank: Columns of P and Q (>= 1).
        seed: Shared by every rank.
    """

    def __init__(self, rank: int, seed: int = 0, error_feedback: bool = True,
                 name: Optional[str] = None):
        super().__init__(error_feedback, name)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"powersgd needs an integer rank >= 1. Received: rank={rank!r}")
        self.rank, self.seed = rank, int(seed)

    codec_name = "powersgd"

    def _options(self):
        return {**super()._options(), "rank": self.rank, "seed": self.seed}

    def _accepts(self, tensor):
        if not super()._accepts(tensor) or tensor.shape.rank < 2:
            return False
        n = int(tensor.shape[0])
        m = _wire.numel(tensor.shape) // n
        return (n + m) * self.rank < n * m

    def _roundtrip(self, flat, shape):
        n = int(shape[0])
        matrix = tf.reshape(flat, [n, -1])
        q = tf.constant(powersgd_initial_q(int(matrix.shape[1]), self.rank, self.seed, "auto"))
        p = tf.linalg.qr(tf.matmul(matrix, q), full_matrices=False).q
        return tf.matmul(p, tf.matmul(matrix, p, transpose_a=True), transpose_b=True)

    def _reduce(self, tensors, names, average, priorities, extra):
        matrices, firsts = [], []
        for x, name, priority in zip(tensors, names, priorities):  # round 1: P
            n = int(x.shape[0])
            m = _wire.numel(x.shape) // n
            flat, residual = self._with_residual(name, tf.reshape(tf.cast(x, tf.float32), [-1]))
            matrix = tf.reshape(flat, [n, m])
            q = self._variable(f"q/{name}", lambda m=m, name=name: powersgd_initial_q(
                m, self.rank, self.seed, name))  # the torch adapter's Q too
            matrices.append((matrix, q, residual))
            firsts.append(_wire.Item(tf.matmul(matrix, q), f"{name}.P", True, 0, priority))
        outs = _wire.transfer(firsts + extra)
        seconds, ps = [], []
        for (matrix, _, _), p, name, priority in zip(matrices, outs, names, priorities):
            p = tf.linalg.qr(p, full_matrices=False).q  # the same on every rank: same input
            ps.append(p)
            seconds.append(_wire.Item(tf.matmul(matrix, p, transpose_a=True), f"{name}.Q", True,
                                      0, priority))  # round 2: Q
        qs = _wire.transfer(seconds)
        scale = 1.0 if average else float(engine.size())
        results = []
        for (matrix, q, residual), p, new_q in zip(matrices, ps, qs):
            _keep_finite(q, new_q, new_q)
            approx = tf.matmul(p, new_q, transpose_b=True)
            if residual is not None:
                _keep_finite(residual, tf.reshape(matrix - approx, [-1]), matrix)
            results.append(approx * scale)
        return results, outs[len(firsts):]


def _keep_finite(variable: tf.Variable, value: tf.Tensor, source: tf.Tensor) -> None:
    """Assigns ``value`` unless ``source`` holds an inf or NaN (or is a False flag): a
    loss-scaled step that overflowed (skipped by a LossScaleOptimizer) must not poison
    the state for good."""
    ok = source if source.dtype == tf.bool else tf.reduce_all(tf.math.is_finite(source))
    variable.assign(tf.where(ok, value, variable))


def _ratio(kind: str, ratio) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"{kind} needs a ratio in (0, 1]. Received: ratio={ratio!r}")
    return float(ratio)
