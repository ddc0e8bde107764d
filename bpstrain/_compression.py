"""The framework-neutral half of gradient compression: what every adapter shares.

* The classic stateless interface (Horovod/BytePS ``Compression``): :class:`Compressor`,
  :class:`NoneCompressor`, :class:`HalfCompressor` (fp16/bf16 casts); each adapter
  supplies its tensor operations (:mod:`bpstrain.torch.compression`,
  :mod:`bpstrain.tensorflow.compression`).
* **Specs**: :func:`parse_compression` turns ``"topk:0.01"`` and friends into a
  :class:`CompressionSpec`, the one description of a codec and its options that an
  adapter builds its compressor from.
* **Per-tensor rules**: :class:`CompressionPolicy` picks the spec of a tensor from its
  name and size (ordered glob rules, a global ``min_size`` below which nothing is
  compressed).
* **auto**: :class:`AutoPolicy` measures, per tensor, what a compressor costs against
  the wire time it saves and turns compression off where it does not pay.
* Seeds every rank derives alike (:func:`derive_seed`, :func:`powersgd_initial_q`).

The wire format of the byte codecs (onebit, top-k, dithering) lives in
:mod:`bpstrain._codec`. Spec strings::

    none | fp16 | bf16
    onebit[:scaled=false]                 sign bits + one magnitude per chunk
    topk:<ratio>[:momentum=<m>]           the ceil(ratio*n) largest magnitudes per chunk
    randomk:<ratio>[:seed=<int>]          ratio*n entries at indices every rank derives
    dithering:<levels>[:stochastic=false] int8 levels of max|x| per chunk
    powersgd:<rank>[:seed=<int>]          low-rank P, Q (Vogels et al.); 1-D goes plain
    auto[:<spec>][:steps=<n>][:bandwidth=<bytes/s>]   <spec> (default fp16) where it pays

Every lossy codec takes ``error_feedback=false`` (worker-side residual, on by default);
top-k takes ``momentum=<m>``: DGC's momentum correction (the worker applies SGD's momentum
before sparsifying; the optimizer, of that momentum, steps by the sent sums);
onebit, top-k and dithering take ``server_error_feedback=false`` (the servers' residual)
and ``chunk=<elements>`` (elements per blob). Options are ``key=value`` pieces after
``:`` or ``,``: ``"topk:0.01,error_feedback=false"``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import logging
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from bpstrain import _codec

log = logging.getLogger("bpstrain.compression")


# -- the classic stateless interface ------------------------------------------------------

class Compressor:
    """Interface: ``compress`` before sending, ``decompress`` after receiving."""

    @staticmethod
    def compress(tensor) -> Tuple[Any, Any]:
        """Returns the tensor to send and a context for :meth:`decompress`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx: Any):
        """Undoes :meth:`compress` on the received tensor."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class HalfCompressor(Compressor):
    """Sends floating-point tensors as a 16-bit float type (half the bytes); others unchanged.

    Subclasses say how their framework does it: ``_prepare`` (turn the input into a
    tensor), ``_dtype``, ``_is_floating``, ``_cast`` and the ``_half`` dtype (float16
    or bfloat16).
    """

    _half: Any = None

    @classmethod
    def _prepare(cls, tensor):
        return tensor

    @classmethod
    def compress(cls, tensor):
        tensor = cls._prepare(tensor)
        dtype = cls._dtype(tensor)
        if cls._is_floating(dtype) and dtype != cls._half:
            tensor = cls._cast(tensor, cls._half)
        return tensor, dtype

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None or cls._dtype(tensor) == ctx else cls._cast(tensor, ctx)


# -- specs ----------------------------------------------------------------------------------

CODECS = ("none", "fp16", "bf16", "onebit", "topk", "randomk", "dithering", "powersgd", "auto")
CASTS = ("fp16", "bf16")
"""Lossless-enough codecs: a cast, no state, no error feedback by default."""
BYTE_CODECS = ("onebit", "topk", "dithering")
"""Codecs that travel as engine dtype ``"compressed"`` (blobs of :mod:`bpstrain._codec`)."""
AUTO_DEFAULT = "fp16"
"""What plain ``auto`` wraps: fp16 never costs accuracy and a cast is cheap, so on a
slow link it halves the bytes and on a fast one the policy turns it off. Ask for more
with ``auto:onebit`` or ``auto:topk:0.01``."""
DEFAULT_MIN_SIZE = 1024
"""Elements below which :class:`CompressionPolicy` compresses nothing: a small tensor's
cost is the operation, not its bytes."""

_POSITIONAL = {"topk": "ratio", "randomk": "ratio", "dithering": "levels", "powersgd": "rank",
               "onebit": "scaled"}
# Options each codec accepts (error_feedback everywhere a residual makes sense).
_OPTIONS = {
    "none": (), "fp16": (), "bf16": (),
    "onebit": ("scaled", "error_feedback", "server_error_feedback", "chunk"),
    "topk": ("ratio", "momentum", "error_feedback", "server_error_feedback", "chunk"),
    "dithering": ("levels", "stochastic", "seed", "error_feedback", "server_error_feedback", "chunk"),
    "randomk": ("ratio", "seed", "error_feedback"),
    "powersgd": ("rank", "seed", "error_feedback"),
    "auto": ("steps", "bandwidth"),
}


@dataclasses.dataclass(frozen=True)
class CompressionSpec:
    """One codec and its options; ``str(spec)`` parses back to an equal spec.

    Attributes:
        codec: one of :data:`CODECS`.
        ratio: top-k / random-k: the share of elements sent, in (0, 1].
        levels: dithering: quantization levels s, 1..127.
        rank: PowerSGD: the rank of the approximation (>= 1).
        scaled: onebit: send mean |x| as the magnitude (else 1).
        stochastic: dithering: workers round stochastically (unbiased); else to nearest.
        seed: random-k indices, PowerSGD's first Q, dithering's rounding.
        error_feedback: worker-side residual; None = on for lossy codecs, off for casts.
        server_error_feedback: onebit/top-k/dithering: the servers keep a residual too.
        chunk: elements per blob of a byte codec (:data:`bpstrain._codec.DEFAULT_CHUNK`).
        momentum: top-k: DGC's momentum correction (Lin et al., 2018) for an SGD of this
            momentum, 0 = off: the worker accumulates the velocity, the residual sums it,
            both are cleared where sent, and the optimizer is handed what makes its
            update the sent sum (``DistributedOptimizer`` checks its momentum).
        steps: auto: steps measured before deciding.
        bandwidth: auto: link bytes/s to price saved bytes (None: the engine's or measured).
        inner: auto: the spec it switches on or off.
    """

    codec: str = "none"
    ratio: float = 0.0
    levels: int = 0
    rank: int = 0
    scaled: bool = True
    stochastic: bool = True
    seed: int = 0
    error_feedback: Optional[bool] = None
    server_error_feedback: bool = True
    chunk: int = _codec.DEFAULT_CHUNK
    momentum: float = 0.0
    steps: int = 5
    bandwidth: Optional[float] = None
    inner: Optional["CompressionSpec"] = None

    @property
    def lossy(self) -> bool:
        """True for codecs that lose more than a cast does (they get error feedback)."""
        return self.codec not in ("none",) + CASTS and not (
            self.codec == "auto" and self.inner is not None and not self.inner.lossy)

    @property
    def ef(self) -> bool:
        """Whether the worker keeps an error-feedback residual for this codec."""
        if self.codec in ("none", "auto") + CASTS:
            return False
        return True if self.error_feedback is None else bool(self.error_feedback)

    @property
    def wire_codec(self) -> int:
        """The :mod:`bpstrain._codec` id of a byte codec (0 for the others)."""
        return _codec.CODECS.get(self.codec, 0)

    def __str__(self) -> str:
        if self.codec == "auto":
            opts = [f"steps={self.steps}"] if self.steps != 5 else []
            if self.bandwidth is not None:
                opts.append(f"bandwidth={self.bandwidth:g}")
            return ":".join(["auto", *opts, str(self.inner or AUTO_DEFAULT)])
        default = CompressionSpec()
        parts = [self.codec]
        for key in _OPTIONS[self.codec]:
            value = getattr(self, key)
            if value != getattr(default, key):
                parts.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
        return ":".join(parts)


def _to_bool(key: str, text: str) -> bool:
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"compression option {key} takes true or false. Received: {key}={text!r}")


def _convert(codec: str, key: str, value: Any) -> Any:
    if key not in _OPTIONS[codec]:
        allowed = ", ".join(_OPTIONS[codec]) or "no options"
        raise ValueError(f"compression {codec} takes {allowed}. Received: {key}={value!r}")
    try:
        if key in ("scaled", "stochastic", "server_error_feedback", "error_feedback"):
            return value if isinstance(value, bool) else _to_bool(key, value)
        if key in ("ratio", "bandwidth", "momentum"):
            return float(value)
        return int(value)
    except (TypeError, ValueError) as exc:
        if "Received" in str(exc):
            raise
        raise ValueError(f"compression option {key} of {codec} must be a number. "
                         f"Received: {key}={value!r}") from None


def _check(spec: CompressionSpec) -> CompressionSpec:
    c = spec.codec
    if c in ("topk", "randomk") and not 0 < spec.ratio <= 1:
        raise ValueError(f"{c} needs a ratio in (0, 1], e.g. '{c}:0.01'. Received: ratio={spec.ratio}")
    if not 0 <= spec.momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), e.g. '{c}:0.01:momentum=0.9'. "
                         f"Received: momentum={spec.momentum}")
    if spec.momentum and not spec.ef:
        raise ValueError("momentum correction accumulates into the error-feedback residual: it "
                         f"needs error_feedback on. Received: {c}:momentum={spec.momentum}:error_feedback=false")
    if c == "dithering" and not 1 <= spec.levels <= 127:
        raise ValueError("dithering needs levels in 1..127, e.g. 'dithering:16'. "
                         f"Received: levels={spec.levels}")
    if c == "powersgd" and spec.rank < 1:
        raise ValueError(f"powersgd needs a rank >= 1, e.g. 'powersgd:2'. Received: rank={spec.rank}")
    if spec.chunk < 1 or spec.steps < 1:
        raise ValueError(f"chunk and steps must be >= 1. Received: chunk={spec.chunk}, steps={spec.steps}")
    if c == "auto" and spec.inner is not None and spec.inner.codec in ("auto", "none"):
        raise ValueError(f"auto wraps a compressing codec. Received: auto:{spec.inner}")
    if c == "auto" and spec.inner is not None and spec.inner.momentum:
        raise ValueError("auto sends some tensors plain, where momentum correction's gradients would "
                         f"be wrong; use {spec.inner} without auto. Received: auto:{spec.inner}")
    if spec.error_feedback:  # on is the lossy codecs' default: one spelling, equal specs
        spec = dataclasses.replace(spec, error_feedback=None)
    return spec


def parse_compression(spec: Union[str, CompressionSpec, Dict[str, Any], None]) -> CompressionSpec:
    """Reads a compression spec (see the module docstring for the grammar).

    Args:
        spec: a string (``"topk:0.01"``, ``"onebit:scaled=false"``, ``"auto:topk:0.01"``),
            a :class:`CompressionSpec` (returned as is), a dict ``{"codec": "topk",
            "ratio": 0.01, ...}`` (an ``inner`` of auto may be a spec too), or None
            (``"none"``).

    Raises:
        ValueError: unknown codec or option, or a value out of range (the message says
            what is accepted and what was received).

    Example::

        >>> str(parse_compression("topk:0.01,error_feedback=false"))
        'topk:ratio=0.01:error_feedback=false'
    """
    if spec is None:
        return CompressionSpec()
    if isinstance(spec, CompressionSpec):
        return spec
    if isinstance(spec, dict):
        fields = dict(spec)
        codec = str(fields.pop("codec", fields.pop("name", "none"))).lower()
        if codec not in CODECS:
            raise ValueError(f"unknown compression; expected one of {', '.join(CODECS)}. "
                             f"Received: {codec!r}")
        inner = fields.pop("inner", None)
        values = {k: _convert(codec, k, v) for k, v in fields.items()}
        if codec == "auto":
            values["inner"] = parse_compression(inner if inner is not None else AUTO_DEFAULT)
        return _check(CompressionSpec(codec=codec, **values))
    if not isinstance(spec, str):
        raise ValueError("compression is a spec string such as 'topk:0.01', a dict or a "
                         f"CompressionSpec. Received: {type(spec).__name__}")
    tokens = [t.strip() for t in spec.replace(",", ":").split(":") if t.strip()]
    if not tokens:
        return CompressionSpec()
    codec = tokens[0].lower()
    if codec not in CODECS:
        raise ValueError(f"unknown compression; expected one of {', '.join(CODECS)}. Received: {spec!r}")
    values: Dict[str, Any] = {}
    rest = tokens[1:]
    if codec == "auto":
        while rest and "=" in rest[0]:  # auto's own options come before the inner spec
            key, value = rest.pop(0).split("=", 1)
            values[key.strip()] = _convert(codec, key.strip(), value)
        values["inner"] = parse_compression(":".join(rest) if rest else AUTO_DEFAULT)
        return _check(CompressionSpec(codec="auto", **values))
    for i, token in enumerate(rest):
        if "=" in token:
            key, value = (s.strip() for s in token.split("=", 1))
        elif i == 0 and codec in _POSITIONAL:
            key, value = _POSITIONAL[codec], token
        else:
            raise ValueError(f"compression options are key=value after the codec (one positional "
                             f"value first for {', '.join(_POSITIONAL)}). Received: {spec!r}")
        values[key] = _convert(codec, key, value)
    if codec == "dithering" and "levels" not in values:
        raise ValueError(f"dithering needs its levels, e.g. 'dithering:16'. Received: {spec!r}")
    return _check(CompressionSpec(codec=codec, **values))


def blob_layout(spec: CompressionSpec, numel: int) -> Tuple[int, int]:
    """(total bytes, bytes of the blob of a full chunk) of a byte codec's wire string.

    The second is the ``partition_bytes`` an adapter passes to the engine, so that every
    partition holds whole blobs.
    """
    codec = spec.wire_codec
    chunk = min(spec.chunk, max(numel, 1))
    k = _codec.topk_count(chunk, spec.ratio) if codec == _codec.TOPK else chunk
    return (_codec.compressed_bytes(codec, numel, spec.chunk, spec.ratio),
            _codec.blob_bytes(codec, chunk, k))


def wire_bytes(spec: CompressionSpec, numel: int, element_size: int = 4) -> int:
    """Bytes one rank sends for a tensor of ``numel`` elements under ``spec`` (push side).

    For PowerSGD this is the P and Q of a square-ish matrix approximated as (n, m) =
    (numel, 1) when the shape is unknown; adapters that know the shape price it better.
    """
    c = spec.codec
    if c in BYTE_CODECS:
        return blob_layout(spec, numel)[0]
    if c in CASTS:
        return 2 * numel
    if c == "randomk":
        return 4 * _codec.topk_count(numel, spec.ratio)
    if c == "auto":
        return wire_bytes(spec.inner or parse_compression(AUTO_DEFAULT), numel, element_size)
    return element_size * numel


def check_momentum_correction(spec: CompressionSpec, momentum: Optional[float], dampening: float = 0.0,
                              nesterov: bool = False) -> None:
    """Raises unless an optimizer of this ``momentum`` (None: it has none), ``dampening``
    and ``nesterov`` may take ``spec``'s gradients: a momentum-corrected compressor hands
    SGD S_t - m*S_{t-1}, which is DGC's update only for plain SGD with that same m."""
    m = spec.momentum
    if not m:
        return
    if momentum is None or abs(float(momentum) - m) > 1e-12 or dampening or nesterov:
        raise ValueError(
            f"compression '{spec}' applies DGC's momentum correction for an SGD with momentum={m} "
            "(no dampening, no Nesterov); build the optimizer so, or drop momentum= from the "
            f"compression. Received: momentum={momentum}, dampening={dampening}, nesterov={nesterov}")


def check_optimizer_momentum(compression: Any, momentum: Optional[float], nesterov: bool = False) -> None:
    """:func:`check_momentum_correction` for every spec a compressor's policy may give a
    tensor (its default and its rules'); compressors without a policy pass."""
    policy = getattr(compression, "policy", None)
    if isinstance(policy, CompressionPolicy):
        for spec in [policy.default] + [rule.compression for rule in policy.rules]:
            check_momentum_correction(spec, momentum, nesterov=nesterov)


# -- seeds every rank derives alike ---------------------------------------------------------

def derive_seed(seed: int, key: str, *extra: Any) -> int:
    """A 63-bit seed from (seed, tensor key, extras): equal on every rank and framework."""
    text = "/".join(str(x) for x in (seed, key) + extra)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def powersgd_initial_q(m: int, rank: int, seed: int, key: str) -> np.ndarray:
    """PowerSGD's first Q (m x rank, float32, standard normal): the same on every rank, so
    the summed P = M Q of the first step is meaningful. numpy-made, so every adapter and
    device starts from the same Q."""
    rng = np.random.default_rng(derive_seed(seed, key, "powersgd.q"))
    return rng.standard_normal((m, rank)).astype(np.float32)


# -- per-tensor rules -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Rule:
    """Tensors whose name matches ``pattern`` (``fnmatch`` glob) and that have at least
    ``min_size`` elements use ``compression``."""

    pattern: str
    compression: CompressionSpec
    min_size: int = 0


def _rule(item: Any) -> Rule:
    if isinstance(item, Rule):
        return item
    if isinstance(item, dict):
        unknown = set(item) - {"pattern", "compression", "min_size"}
        if unknown or "pattern" not in item:
            raise ValueError("a compression rule is {pattern, compression, min_size}. "
                             f"Received: {item!r}")
        return Rule(str(item["pattern"]), parse_compression(item.get("compression", "none")),
                    int(item.get("min_size", 0)))
    if isinstance(item, (tuple, list)) and len(item) in (2, 3):
        return Rule(str(item[0]), parse_compression(item[1]), int(item[2]) if len(item) == 3 else 0)
    raise ValueError("a compression rule is a dict {pattern, compression, min_size} or a tuple "
                     f"(pattern, compression[, min_size]). Received: {item!r}")


class CompressionPolicy:
    """Which spec each tensor gets: ordered rules, a default, a global minimum size.

    Args:
        default: the spec of tensors no rule matches (string, dict or spec).
        rules: ordered; the first rule whose pattern matches the tensor's name and whose
            ``min_size`` the tensor reaches wins. Each is a :class:`Rule`, a dict
            ``{"pattern": "*.bias", "compression": "none", "min_size": 0}`` or a tuple.
        min_size: tensors with fewer elements are never compressed (default
            :data:`DEFAULT_MIN_SIZE`).

    Example::

        policy = CompressionPolicy("topk:0.01", rules=[{"pattern": "*embedding*",
                                                        "compression": "fp16"}])
        policy.spec_for("encoder.embedding.weight", 10**6)   # fp16
        policy.spec_for("fc.bias", 10)                        # none (below min_size)
    """

    def __init__(self, default: Any = "none", rules: Sequence[Any] = (),
                 min_size: int = DEFAULT_MIN_SIZE):
        self.default = parse_compression(default)
        self.rules: List[Rule] = [_rule(r) for r in rules or ()]
        if int(min_size) < 0:
            raise ValueError(f"min_size must be >= 0. Received: min_size={min_size}")
        self.min_size = int(min_size)

    def spec_for(self, name: str, numel: int) -> CompressionSpec:
        """The spec of tensor ``name`` with ``numel`` elements."""
        if numel < self.min_size:
            return CompressionSpec()
        for rule in self.rules:
            if numel >= rule.min_size and fnmatch.fnmatchcase(name, rule.pattern):
                return rule.compression
        return self.default

    def bucket_spec(self) -> CompressionSpec:
        """The spec of fused buckets of small tensors: the default when it is a cast
        (fp16/bf16), else none (lossy codecs work per tensor, by name)."""
        return self.default if self.default.codec in CASTS else CompressionSpec()

    def __repr__(self) -> str:
        rules = ", ".join(f"({r.pattern!r}, '{r.compression}', {r.min_size})" for r in self.rules)
        return f"CompressionPolicy('{self.default}', rules=[{rules}], min_size={self.min_size})"


def parse_policy(value: Any, rules: Sequence[Any] = (), min_size: Optional[int] = None
                 ) -> CompressionPolicy:
    """A :class:`CompressionPolicy` from a policy, a spec, or a dict ``{"compression" (or
    "default"), "rules", "min_size"}`` (the Trainer config's shape); ``rules`` and
    ``min_size`` given here apply when ``value`` does not carry its own."""
    if isinstance(value, CompressionPolicy):
        return value
    if isinstance(value, dict) and ("rules" in value or "default" in value or "min_size" in value
                                    or "compression" in value):
        known = {"compression", "default", "rules", "min_size"}
        if set(value) - known:
            raise ValueError(f"a compression policy takes {', '.join(sorted(known))}. "
                             f"Received: {sorted(value)}")
        default = value.get("compression", value.get("default", "none"))
        return CompressionPolicy(default, value.get("rules", rules),
                                 value.get("min_size", DEFAULT_MIN_SIZE if min_size is None else min_size))
    return CompressionPolicy(value, rules, DEFAULT_MIN_SIZE if min_size is None else min_size)


# -- auto -----------------------------------------------------------------------------------

def engine_bandwidth() -> Optional[float]:
    """The link bandwidth (bytes/s) the engine measured, where it reports one
    (``stats()["link_bytes_per_s"]``); None otherwise (standalone, or not reported)."""
    try:
        from bpstrain import engine

        value = engine.stats().get("link_bytes_per_s", 0) if engine.is_initialized() else 0
    except Exception:  # an engine without the counter: measure instead
        return None
    return float(value) if value and value > 0 else None


AUTO_CLEAR_MARGIN = 4.0
"""``auto`` trusts its cost model where the wire time saved and the codec's cost differ by
this factor; in between (a fast link, or a codec that shares the cores with the transport,
as on one host) it times training steps both ways before deciding (see :class:`AutoPolicy`)."""


def _typical(periods: List[float]) -> float:
    """The median step, leaving out the first (it crosses the switch between ways of
    sending); NaN with none timed (a resume in the middle), which never compresses."""
    timed = periods[1:] if len(periods) > 1 else periods
    return statistics.median(timed) if timed else float("nan")


@dataclasses.dataclass
class _Track:
    seen: int = 0
    measured: int = 0
    raw_seconds: List[float] = dataclasses.field(default_factory=list)
    codec_seconds: List[float] = dataclasses.field(default_factory=list)
    raw_bytes: int = 0
    sent_bytes: int = 0
    on: Optional[bool] = None
    pending: Optional[int] = None  # the engine handle of the ranks' mean, while in flight
    stage: str = "measure"         # measure -> (trial -> compare, when not clear) -> decided
    trial_steps: int = 0
    compare_steps: int = 0
    trial_periods: List[float] = dataclasses.field(default_factory=list)
    compare_periods: List[float] = dataclasses.field(default_factory=list)
    last_call: Optional[float] = None
    last_arm: str = ""             # "trial" or "compare": the step its next call closes


class AutoPolicy:
    """Per tensor: compress only where it saves more time than it costs.

    For each tensor (by key) the first steps measure; then every rank takes the same,
    sticky decision, logged once at info level on ``bpstrain.compression``:

    * cost = median seconds of compress + decompress over the measured steps;
    * saved = bytes saved on push and pull / bandwidth, with the bandwidth from the
      ``bandwidth`` argument, else the engine's measured link
      (:func:`engine_bandwidth`), else from one uncompressed push_pull of the tensor
      (its first step; saved = that time x the share of bytes saved). That time runs
      from enqueue to the result, so where the adapter overlaps it with other work it
      overestimates the wire time: such a guess errs towards compressing.
    * Both are averaged over the ranks (one tiny push_pull per tensor, ``<name>.auto``).
      Where they differ by :data:`AUTO_CLEAR_MARGIN` or more, that settles it (a slow link
      saves far more than the codec costs). Otherwise the model is too coarse to trust —
      on one host the "wire" is the same cores the codec needs — so the tensor is sent
      compressed for ``steps`` + 1 steps and uncompressed for as many (phase
      ``"compare"``), timing the whole step between two calls for the tensor, and it is
      compressed only if the ranks' median compressed step was shorter. A few such steps
      cost little, since they only happen where the two ways are close.

    The ranks' means start after the step that completes a stage and are waited for one
    step later (that tensor keeps the stage's way of sending meanwhile): a rank never
    blocks inside a gradient hook on a collective another rank has not started, whatever
    order hooks fire in.

    Adapters call :meth:`phase` once per step and tensor, before its push_pull, and report
    what they measured with :meth:`record_raw` / :meth:`record_codec`.

    Args:
        steps: compressed steps measured before deciding.
        bandwidth: link bytes per second (None: the engine's, else measured).
        reduce: ``(values, name) -> mean over ranks``, blocking (default: the engine's
            push_pull, started one step ahead as said above).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, steps: int = 5, bandwidth: Optional[float] = None,
                 reduce: Optional[Callable[[np.ndarray, str], np.ndarray]] = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.steps = int(steps)
        self.bandwidth = bandwidth
        self.reduce = reduce
        self.clock = clock
        self._tracks: Dict[str, _Track] = {}

    def _link(self) -> Optional[float]:
        return self.bandwidth if self.bandwidth else engine_bandwidth()

    def phase(self, key: str, name: str) -> str:
        """What to do with tensor ``key`` this step: ``"raw"`` (send uncompressed and
        time it), ``"measure"`` (compress and time the codec), ``"on"``, ``"off"``, or
        ``"compare"`` (send uncompressed as ``"off"`` does; the policy times the step).

        Deciding is collective: every rank calls this for the same tensors and steps
        (``name`` is the tensor's engine name, the same on every rank).
        """
        t = self._tracks.setdefault(key, _Track())
        now = self.clock()
        if t.last_arm and t.last_call is not None:  # the step since the last call, timed
            (t.trial_periods if t.last_arm == "trial" else t.compare_periods).append(now - t.last_call)
        t.last_call, t.last_arm = now, ""
        # Counted in calls, not in measurements received, so every rank moves on at the
        # same step whatever its timing.
        if t.on is None and t.stage == "measure" and t.measured >= self.steps:
            mean = self._mean(name, t, self._local_figures)
            if mean is not None:
                self._judge_model(key, t, cost=mean[0], saved=mean[1])
        if t.on is None and t.stage == "trial":
            if t.trial_steps <= self.steps:
                t.trial_steps += 1
                t.last_arm = "trial"
                return "on"
            t.stage = "compare"
        if t.on is None and t.stage == "compare":
            if t.compare_steps <= self.steps:
                t.compare_steps += 1
                t.last_arm = "compare"
                return "compare"
            mean = self._mean(name, t, lambda tr: np.array(
                [_typical(tr.trial_periods), _typical(tr.compare_periods)]))
            if mean is None:
                return "compare"
            self._settle(key, t, bool(mean[0] < mean[1]),  # a tie keeps the exact path
                         "compressed steps took %.3f ms against %.3f ms uncompressed (median, mean "
                         "over ranks)", 1e3 * mean[0], 1e3 * mean[1])
        if t.on is not None:
            return "on" if t.on else "off"
        t.seen += 1
        if t.seen == 1 and self._link() is None:
            return "raw"
        t.measured += 1
        return "measure"

    def record_raw(self, key: str, seconds: float, raw_bytes: int) -> None:
        """An uncompressed push_pull of ``raw_bytes`` took ``seconds``."""
        t = self._tracks.setdefault(key, _Track())
        t.raw_seconds.append(float(seconds))
        t.raw_bytes = int(raw_bytes)

    def record_codec(self, key: str, seconds: float, raw_bytes: int, sent_bytes: int) -> None:
        """Compressing and decompressing ``raw_bytes`` into ``sent_bytes`` took ``seconds``."""
        t = self._tracks.setdefault(key, _Track())
        t.codec_seconds.append(float(seconds))
        t.raw_bytes, t.sent_bytes = int(raw_bytes), int(sent_bytes)

    def decision(self, key: str) -> Optional[bool]:
        """True/False once decided for ``key``; None while measuring."""
        t = self._tracks.get(key)
        return None if t is None else t.on

    def _mean(self, name: str, t: _Track, figures: Callable[[_Track], np.ndarray]) -> Optional[np.ndarray]:
        """The ranks' mean of ``figures(t)``; None while it is in flight (engine only)."""
        if self.reduce is not None:
            return np.asarray(self.reduce(np.asarray(figures(t), np.float64), f"{name}.auto"))
        from bpstrain import engine

        if t.pending is None:
            t.pending = engine.push_pull_async(np.asarray(figures(t), np.float64), name=f"{name}.auto")
            return None
        handle, t.pending = t.pending, None
        return np.asarray(engine.synchronize(handle))

    def _judge_model(self, key: str, t: _Track, cost: float, saved: float) -> None:
        how = ("codec %.3f ms against %.3f ms of wire time saved per step (mean over ranks)",
               1e3 * cost, 1e3 * saved)
        if saved > 0 and saved >= AUTO_CLEAR_MARGIN * cost:
            self._settle(key, t, True, *how)
        elif saved * AUTO_CLEAR_MARGIN <= cost:
            self._settle(key, t, False, *how)
        else:
            t.stage = "trial"
            log.debug("auto compression for %s: " + how[0] + "; timing steps both ways", key,
                      *how[1:])

    @staticmethod
    def _settle(key: str, t: _Track, on: bool, why: str, *args: float) -> None:
        t.on = on
        log.info("auto compression %s for %s: " + why, "on" if on else "off", key, *args)

    def _local_figures(self, t: _Track) -> np.ndarray:
        """[cost, saved] in seconds per step, as this rank measured them."""
        # The first call often pays allocations and kernel loading: the median ignores it.
        cost = statistics.median(t.codec_seconds) if t.codec_seconds else 0.0
        saved_share = max(0, t.raw_bytes - t.sent_bytes)
        link = self._link()
        if link:
            saved = 2.0 * saved_share / link  # push and pull each cross the link
        elif t.raw_seconds and t.raw_bytes:
            saved = min(t.raw_seconds) * saved_share / t.raw_bytes
        else:
            saved = 0.0
        return np.array([cost, saved], np.float64)

    def state_dict(self) -> Dict[str, Any]:
        """Decisions and measurements, for a checkpoint (decisions stay sticky on resume)."""
        # An in-flight mean is not saved: a resumed job starts it again, on every rank alike.
        # Nor is a clock reading: a step that spans the resume is not timed.
        return {k: {**dataclasses.asdict(t), "pending": None, "last_call": None, "last_arm": ""}
                for k, t in self._tracks.items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`."""
        self._tracks = {k: _Track(**v) for k, v in state.items()}
