"""Stateful gradient compressors: error feedback, step counters, multi-round codecs.

The classic ``compress -> push_pull -> decompress`` interface has no tensor name, no
step and one round, which error feedback (a residual per tensor), random-k (indices
from name and step), the byte codecs (engine dtype ``"compressed"``, summed and
re-encoded by the servers) and PowerSGD (two rounds, P then Q) all need. Here a
compressor starts the whole operation itself and hands back an engine handle::

    comp = Compression.topk(0.01)                       # keep it: it holds the residuals
    handle = comp.push_pull_async(grad, name="fc.weight")
    avg = bps.synchronize(handle)                       # decoded and averaged

Internally :meth:`GradientCompressor.start` returns an operation object with
``poll()``/``wait(timeout)`` that :func:`bpstrain.engine.track` puts in the engine's one
handle table, so the optimizer, CrossBarrier and ``bps.synchronize`` treat it like any
other push_pull. Every encode and decode runs with torch ops on the tensor's device.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from bpstrain import _codec, engine
from bpstrain._compression import (AutoPolicy, CompressionPolicy, CompressionSpec, NoneCompressor,
                                   blob_layout, derive_seed, parse_compression, parse_policy,
                                   powersgd_initial_q)
from bpstrain.engine import Op
from bpstrain.torch import _codecs


class _LazyOps:
    """``bpstrain.torch.ops`` at call time: ops imports this module (through
    compression.py), so importing it here at load time would be circular."""

    def __getattr__(self, name):
        from bpstrain.torch import ops

        return getattr(ops, name)


_ops = _LazyOps()


class _Clock:
    """Adds up the seconds of the blocks it times; on CUDA it synchronizes around them,
    which only the measuring steps of ``auto`` ask for (``on``)."""

    def __init__(self, device: torch.device, on: bool):
        self.on, self.cuda, self.total, self._t0 = on, on and device.type == "cuda", 0.0, 0.0
        self.device = device

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.total += time.perf_counter() - self._t0


class _Op:
    """An operation a compressor started: ``poll``/``wait`` for :func:`engine.track`.

    ``finish`` turns what ``handle`` returns into the result (decoding); ``codec_seconds``
    (compress + decompress, timed when asked), ``raw_bytes`` and ``sent_bytes`` are what
    ``auto`` learns from.
    """

    def __init__(self, handle: int, finish, clock: _Clock, raw_bytes: int, sent_bytes: int):
        self.handle, self.finish, self.clock = handle, finish, clock
        self.raw_bytes, self.sent_bytes = raw_bytes, sent_bytes
        self.result = None
        self.done_callback = None

    @property
    def codec_seconds(self) -> float:
        return self.clock.total

    def poll(self) -> bool:
        return self.result is not None or engine.poll(self.handle)

    def wait(self, timeout: Optional[float] = None):
        if self.result is None:
            value = engine.synchronize(self.handle, timeout)  # a timeout leaves it pending
            with self.clock:
                self.result = self.finish(value)
            if self.done_callback is not None:
                self.done_callback(self)
        return self.result


def _flat32(tensor: torch.Tensor, spec: CompressionSpec) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"compression '{spec}' works on floating-point tensors. Received: {got}")
    if tensor.layout != torch.strided:
        raise ValueError(f"compression '{spec}' works on dense tensors; densify the gradient or "
                         f"send it uncompressed. Received: layout={tensor.layout}")
    return tensor.detach().reshape(-1).to(torch.float32)


def _restore(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return flat.view(like.shape).to(like.dtype)


def copy_result(grad: torch.Tensor, result: torch.Tensor) -> None:
    """Puts a compressor's result into ``grad``, unless it is there already (an
    in-place push_pull wrote into ``grad``'s own memory)."""
    same = (result.data_ptr() == grad.data_ptr() and result.shape == grad.shape
            and result.stride() == grad.stride() and result.dtype == grad.dtype)
    if not same:
        grad.copy_(result)


class GradientCompressor:
    """Base of the stateful compressors (see the module docstring).

    Subclasses implement :meth:`start`. State is per tensor *key* (the name unless the
    caller passes a stable key, as DistributedOptimizer does with parameter names):
    ``step`` (calls so far), ``residual`` (error feedback) and codec extras.

    Attributes:
        spec: the :class:`~bpstrain._compression.CompressionSpec` it was made from.
    """

    def __init__(self, spec: CompressionSpec):
        self.spec = spec
        self._tensors: Dict[str, Dict[str, Any]] = {}

    def push_pull_async(self, tensor: torch.Tensor, name: str, average: bool = True,
                        priority: int = 0, key: Optional[str] = None,
                        inplace: bool = False) -> int:
        """Starts compressing and push_pulling ``tensor``; returns a handle.

        Args:
            tensor: floating-point, CPU or CUDA; left unchanged.
            name: the engine name, the same on every rank (required: state is per tensor).
            average: divide the sum over ranks by :func:`size`.
            priority: larger is sent sooner.
            key: identifies the tensor's state (and random seeds) instead of ``name``.
            inplace: ``tensor`` may be overwritten with the result (the optimizers pass
                their gradients so): a tensor ``auto`` sends uncompressed then needs no
                output buffer and no copy back, as with no compression at all.

        Returns:
            A handle for ``bps.synchronize``, which returns a tensor shaped and typed
            like ``tensor`` (new, or ``tensor`` itself when ``inplace`` let it be).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"compression '{self.spec}' keeps state per tensor and needs its name; "
                             f"pass name=... (the same on every rank). Received: name={name!r}")
        return engine.track(self.start(tensor, name, average, priority, key or name,
                                       inplace=inplace))

    def start(self, tensor: torch.Tensor, name: str, average: bool, priority: int, key: str,
              timed: bool = False, inplace: bool = False) -> _Op:
        """Starts the operation; ``timed`` measures codec time exactly (CUDA: synchronizes);
        ``inplace``: see :meth:`push_pull_async` (compressors that send a copy ignore it)."""
        raise NotImplementedError

    def fork(self) -> "GradientCompressor":
        """A compressor of the same kind and options with no state (one per optimizer)."""
        return from_spec(self.spec)

    def _state(self, key: str) -> Dict[str, Any]:
        return self._tensors.setdefault(key, {"step": 0})

    def _add_residual(self, key: str, x: torch.Tensor) -> torch.Tensor:
        residual = self._state(key).get("residual")
        if residual is None or not self.spec.ef:
            return x
        return x + residual.to(x.device).reshape(x.shape)

    def _with_velocity(self, st: Dict[str, Any], x: torch.Tensor) -> Tuple[torch.Tensor, bool]:
        """DGC's momentum correction, worker side: ``(u, kept)``, the gradient ``x`` (flat
        fp32) made the velocity u = m*u + x, which error feedback then accumulates and the
        codec sparsifies (the codecs must not write into it), and whether u is now the
        kept velocity: a step with an inf or NaN (a loss-scaled overflow) goes out but is
        not kept. Off: ``(x, False)``."""
        m = self.spec.momentum
        if not m:
            return x, False
        before = st.get("velocity")
        u = x.clone() if before is None or before.numel() != x.numel() else before.to(x.device) * m + x
        kept = bool(torch.isfinite(u).all())
        if kept:
            st["velocity"] = u
        return u, kept

    def _as_momentum_gradient(self, st: Dict[str, Any], out: torch.Tensor) -> torch.Tensor:
        """The step's decompressed sum S_t handed to an SGD that keeps its momentum m (the
        same as the spec's): S_t - m*S_{t-1}, so that SGD's buffer m*buf + g equals S_t and
        the update is lr*S_t, DGC's. Tensors the policy sends plain keep ordinary momentum.
        A non-finite sum (an overflow) is handed on but not kept."""
        m = self.spec.momentum
        if not m:
            return out
        before = st.get("applied")
        if bool(torch.isfinite(out).all()):
            st["applied"] = out.detach().clone()
        if before is None or before.numel() != out.numel():
            return out
        return out - m * before.to(out.device)

    def take_residual(self, key: str) -> Optional[torch.Tensor]:
        """Removes and returns ``key``'s error-feedback residual (flat fp32), if any."""
        return self._tensors.get(key, {}).pop("residual", None)

    def state_dict(self) -> Dict[str, Any]:
        """Per-tensor state (copies), for a checkpoint."""
        return {"spec": str(self.spec),
                "tensors": {k: {n: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                for n, v in st.items()} for k, st in self._tensors.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict` (tensors move to each gradient's device at use).

        Raises:
            ValueError: the state was saved by a compressor of other options.
        """
        if state.get("spec") != str(self.spec):
            raise ValueError(f"compressor state of '{state.get('spec')}' cannot be loaded into "
                             f"'{self.spec}'. Received: spec={state.get('spec')!r}")
        self._tensors = {k: dict(st) for k, st in state.get("tensors", {}).items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}('{self.spec}')"


class ClassicCompressor(GradientCompressor):
    """A stateless ``compress``/``decompress`` compressor (none, fp16, bf16, user-written)
    behind the stateful interface."""

    def __init__(self, compressor=NoneCompressor, spec: Optional[CompressionSpec] = None):
        super().__init__(spec or CompressionSpec())
        self.compressor = compressor

    def fork(self) -> "ClassicCompressor":
        return ClassicCompressor(self.compressor, self.spec)

    def start(self, tensor, name, average, priority, key, timed=False, inplace=False):
        clock = _Clock(tensor.device, timed)
        with clock:
            compressed, ctx = self.compressor.compress(tensor.detach())
        handle = _ops.push_pull_async(compressed, average=average, name=name, priority=priority)
        return _Op(handle, lambda out: self.compressor.decompress(out, ctx), clock,
                   tensor.numel() * tensor.element_size(),
                   compressed.numel() * compressed.element_size())


class ByteCodecCompressor(GradientCompressor):
    """onebit, top-k and dithering: blobs of :mod:`bpstrain._codec` as engine dtype
    ``"compressed"``; the servers decode, sum, add their residual and re-encode, so
    the answer is compressed too. Worker-side error feedback: residual = input +
    previous residual − what the sent blob decodes to."""

    def start(self, tensor, name, average, priority, key, timed=False, inplace=False):
        spec = self.spec
        x = _flat32(tensor, spec)
        st = self._state(key)
        clock = _Clock(x.device, timed)
        with clock:
            # Stochastic dithering draws independently per rank and step, reproducibly
            # (a resumed run draws alike).
            stochastic = spec.codec == "dithering" and spec.stochastic
            seed = derive_seed(spec.seed, key, st["step"], engine.rank()) if stochastic else 0
            host_seed = seed % (2**63) + 1 if stochastic else 0
            x, moving = self._with_velocity(st, x)
            kept = st.get("residual")
            if x.device.type == "cpu" and spec.ef and kept is not None and kept.device.type == "cpu" \
                    and kept.numel() == x.numel() and kept.is_contiguous():
                # One residual buffer per tensor: the gradient is added into it and the
                # codec leaves what it did not send there (no 4 bytes/element allocated and
                # page-faulted every step: VGG-16's 553 MB cost seconds on two cores).
                x = kept.view(-1).add_(x.view(-1))
                host, _ = _codecs.encode_host(spec, x, host_seed, into=x)
            elif x.device.type == "cpu":
                x = self._add_residual(key, x)
                host, residual = _codecs.encode_host(spec, x, host_seed, spec.ef)
                if spec.ef:
                    st["residual"] = residual
            else:
                x = self._add_residual(key, x)
                u = None
                if stochastic:
                    gen = torch.Generator(device=x.device)
                    gen.manual_seed(seed)
                    u = torch.rand(x.numel(), generator=gen, device=x.device)
                data, sent = _codecs.encode(spec, x, u)
                if spec.ef:  # as the servers and the host codec: never keep an overflow
                    r = x - sent
                    st["residual"] = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
                host = data.cpu()  # the one staging copy of a CUDA tensor: the bytes alone
            if moving:  # momentum factor masking; top-k leaves a 0 residual where it sent
                st["velocity"].view(-1)[st["residual"].view(-1) == 0] = 0
        st["step"] += 1
        src = host.numpy()
        dst = np.empty_like(src)
        _, part = blob_layout(spec, x.numel())
        # Declared as plain host bytes (no device or layout): the servers' state rounds
        # (bpstrain._server_state) use the name so, and another declaration would make
        # new keys with empty residuals. Ranks that compress differently still fail: the
        # servers refuse blobs that disagree.
        handle = engine.submit(name, "compressed", src.shape, src, dst, Op.SUM, priority=priority,
                               partition_bytes=part)
        count = engine.size()

        def finish(answer):
            # Checked on the host before its indices and lengths are trusted (raises
            # PeerError); decoded there for a CPU tensor, on the GPU for a CUDA one.
            on_host = tensor.device.type == "cpu"
            out = _codecs.check_answer(torch.from_numpy(answer), x.numel(), decode=on_host)
            if not on_host:
                out = _codecs.decode(spec, torch.from_numpy(answer).to(tensor.device), x.numel())
            if average:  # by a device tensor: CUDA divides by a host scalar inexactly
                out.div_(torch.full((), count, dtype=torch.float32, device=out.device))
            return _restore(self._as_momentum_gradient(st, out), tensor)

        return _Op(handle, finish, clock, 4 * x.numel(), src.size)

    def _template(self, numel: int) -> Tuple[bytes, int]:
        """A wire string of the tensor's layout (for state rounds) and its partition bytes."""
        data, _ = _codecs.encode(self.spec, torch.zeros(numel))
        return data.numpy().tobytes(), blob_layout(self.spec, numel)[1]

    def export_server_residual(self, name: str, numel: int) -> Optional[np.ndarray]:
        """The servers' residual of tensor ``name`` (flat fp32), None when they keep none.
        Collective: every rank calls it for the same tensors in the same order."""
        if not self.spec.server_error_feedback:
            return None
        from bpstrain import _server_state

        return _server_state.export_residual(name, *self._template(numel))

    def import_server_residual(self, name: str, numel: int, residual: np.ndarray) -> None:
        """Makes ``residual`` the servers' residual of ``name`` (collective, as export)."""
        from bpstrain import _server_state

        template, part = self._template(numel)
        _server_state.import_residual(name, template, part, residual)


class RandomKCompressor(GradientCompressor):
    """random-k: ``ceil(ratio*n)`` entries at indices every rank derives from (seed,
    key, step) (:func:`bpstrain._codec.randomk_indices`), pushed as plain float32 (the
    servers sum them as any tensor) and scattered back."""

    def start(self, tensor, name, average, priority, key, timed=False, inplace=False):
        spec = self.spec
        x = _flat32(tensor, spec)
        st = self._state(key)
        n = x.numel()
        k = _codec.topk_count(n, spec.ratio)
        clock = _Clock(x.device, timed)
        with clock:
            x = self._add_residual(key, x)
            a, b = _codec.randomk_affine(n, spec.seed, key, st["step"])
            idx = (a + torch.arange(k, device=x.device, dtype=torch.int64) * b) % n
            values = x[idx]
            if spec.ef:
                residual = x.clone()
                residual[idx] = 0
                st["residual"] = residual
        st["step"] += 1
        handle = _ops.push_pull_async(values, average=average, name=name, priority=priority)

        def finish(summed):
            out = torch.zeros(n, dtype=torch.float32, device=x.device)
            out[idx] = summed
            return _restore(out, tensor)

        return _Op(handle, finish, clock, 4 * n, 4 * k)


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``p`` (in place; returns it). A zero column stays
    zero. Written out, not ``torch.linalg.qr``, so every device and the numpy reference
    of the tests compute the same thing."""
    tiny = torch.finfo(p.dtype).tiny
    for i in range(p.shape[1]):
        col = p[:, i]
        col.div_(col.norm().clamp_min(tiny))
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest.sub_(col.unsqueeze(1) * (col @ rest).unsqueeze(0))
    return p


class _PowerOp:
    """PowerSGD's two rounds: P = M Q summed, orthogonalized; Q = Mᵀ P summed; P Qᵀ."""

    def __init__(self, comp, tensor, m, p, name, average, priority, key, clock):
        self.comp, self.tensor, self.m = comp, tensor, m
        self.name, self.average, self.priority, self.key, self.clock = name, average, priority, key, clock
        self.p = None
        self.handle = _ops.push_pull_async(p, average=average, name=f"{name}.P", priority=priority)
        self.stage = "P"
        self.result = None
        self.done_callback = None
        rows, cols = m.shape
        self.raw_bytes, self.sent_bytes = 4 * rows * cols, 4 * (rows + cols) * p.shape[1]

    @property
    def codec_seconds(self) -> float:
        return self.clock.total

    def _second_round(self, timeout):
        p = engine.synchronize(self.handle, timeout)
        with self.clock:
            self.p = orthogonalize(p)
            q = self.m.t() @ self.p
        self.handle = _ops.push_pull_async(q, average=self.average, name=f"{self.name}.Q",
                                           priority=self.priority)
        self.stage = "Q"

    def poll(self) -> bool:
        if self.result is not None:
            return True
        if self.stage == "P":
            if not engine.poll(self.handle):
                return False
            self._second_round(None)  # P is back: Q's round starts now, without blocking
        return engine.poll(self.handle)

    def wait(self, timeout: Optional[float] = None):
        if self.result is None:
            if self.stage == "P":
                self._second_round(timeout)
            q = engine.synchronize(self.handle, timeout)
            with self.clock:
                approx = self.p @ q.t()
                st = self.comp._state(self.key)
                if self.comp.spec.ef:
                    st["residual"] = (self.m - approx).reshape(-1)
                st["q"] = q
                self.result = _restore(approx.reshape(-1), self.tensor)
            if self.done_callback is not None:
                self.done_callback(self)
        return self.result


class PowerSGDCompressor(GradientCompressor):
    """PowerSGD (Vogels et al., 2019) on a parameter server: the servers only sum, and P
    and Q are linear in the gradient, so summing them is summing the approximations.

    Per tensor of 2+ dims, M = gradient (+ residual) as (shape[0], rest); P = M Q (Q
    warm-started from the last step, first drawn from a shared seed:
    :func:`~bpstrain._compression.powersgd_initial_q`), push_pull P, orthogonalize,
    Q = Mᵀ P, push_pull Q, result P Qᵀ; residual = M − P Qᵀ (the averaged
    approximation, as PyTorch's PowerSGD hook keeps it). 1-D tensors, and matrices
    where P and Q would not be smaller, go uncompressed.
    """

    def start(self, tensor, name, average, priority, key, timed=False, inplace=False):
        spec = self.spec
        x = _flat32(tensor, spec)
        rows = tensor.shape[0] if tensor.dim() >= 2 else 0
        cols = x.numel() // rows if rows else 0
        rank = min(spec.rank, rows, cols)
        if tensor.dim() < 2 or (rows + cols) * rank >= rows * cols:
            clock = _Clock(x.device, timed)
            handle = _ops.push_pull_async(tensor.detach(), average=average, name=name, priority=priority)
            return _Op(handle, lambda out: out, clock, 4 * x.numel(), 4 * x.numel())
        st = self._state(key)
        clock = _Clock(x.device, timed)
        with clock:
            m = self._add_residual(key, x).reshape(rows, cols)
            if m.data_ptr() == tensor.data_ptr():  # Q's round reads M later: own a copy
                m = m.clone()
            q = st.get("q")
            if q is None or tuple(q.shape) != (cols, rank):
                q = torch.from_numpy(powersgd_initial_q(cols, rank, spec.seed, key))
            p = m @ q.to(x.device)
        st["step"] += 1
        return _PowerOp(self, tensor, m, p, name, average, priority, key, clock)


class AutoCompressor(GradientCompressor):
    """``auto``: the inner compressor per tensor while it pays (see
    :class:`~bpstrain._compression.AutoPolicy`); uncompressed otherwise, as ``<name>.raw``.

    A tensor switched off sends its inner residual along with its next gradient, so no
    error-feedback mass is lost.
    """

    def __init__(self, spec: CompressionSpec, inner: Optional[GradientCompressor] = None):
        super().__init__(spec)
        self.inner = inner or from_spec(spec.inner or parse_compression("fp16"))
        self.policy = AutoPolicy(spec.steps, spec.bandwidth)

    def fork(self) -> "AutoCompressor":
        return AutoCompressor(self.spec, self.inner.fork())

    def start(self, tensor, name, average, priority, key, timed=False, inplace=False):
        phase = self.policy.phase(key, name)
        if phase in ("on", "measure"):
            op = self.inner.start(tensor, name, average, priority, key,
                                  timed or phase == "measure", inplace)
            if phase == "measure":
                op.done_callback = lambda o: self.policy.record_codec(key, o.codec_seconds,
                                                                      o.raw_bytes, o.sent_bytes)
            return op
        x = tensor.detach()
        residual = self.inner.take_residual(key)
        if residual is not None:
            x, inplace = _restore(x.reshape(-1).to(torch.float32) + residual.to(x.device),
                                  tensor), True  # x is our own copy
        began = time.perf_counter()
        # In place where allowed: a new output buffer (page faults) and a copy back cost
        # what the codec saved on a fast link.
        start = _ops.push_pull_async_inplace if inplace else _ops.push_pull_async
        handle = start(x, average=average, name=f"{name}.raw", priority=priority)
        op = _Op(handle, lambda out: out, _Clock(x.device, False), x.numel() * x.element_size(),
                 x.numel() * x.element_size())
        if phase == "raw":
            op.done_callback = lambda o: self.policy.record_raw(key, time.perf_counter() - began,
                                                                o.raw_bytes)
        return op

    def decision(self, key: str) -> Optional[bool]:
        """True/False once decided for ``key`` (the name, or the optimizer's parameter name)."""
        return self.policy.decision(key)

    def state_dict(self):
        return {"spec": str(self.spec), "inner": self.inner.state_dict(),
                "auto": self.policy.state_dict()}

    def load_state_dict(self, state):
        if state.get("spec") != str(self.spec):
            raise ValueError(f"compressor state of '{state.get('spec')}' cannot be loaded into "
                             f"'{self.spec}'. Received: spec={state.get('spec')!r}")
        self.inner.load_state_dict(state["inner"])
        self.policy.load_state_dict(state["auto"])


class PolicyCompressor(GradientCompressor):
    """Per-tensor choice (:class:`~bpstrain._compression.CompressionPolicy`): each tensor
    key and size picks a spec, each spec has one compressor (and state) here.

    Args:
        policy: the rules (anything :func:`~bpstrain._compression.parse_policy` reads).
        default: a compressor instance to use for the policy's default spec (e.g. a
            user-written :class:`GradientCompressor`); made from the spec otherwise.
    """

    def __init__(self, policy: Any, default: Optional[GradientCompressor] = None):
        self.policy: CompressionPolicy = parse_policy(policy)
        super().__init__(self.policy.default)
        self._default = default
        self._subs: Dict[str, GradientCompressor] = {}

    def fork(self) -> "PolicyCompressor":
        return PolicyCompressor(self.policy, self._default.fork() if self._default else None)

    def compressor(self, spec: CompressionSpec) -> GradientCompressor:
        """The compressor of ``spec`` (made at first use)."""
        text = str(spec)
        sub = self._subs.get(text)
        if sub is None:
            if self._default is not None and spec == self.policy.default:
                sub = self._default
            else:
                sub = from_spec(spec)
            self._subs[text] = sub
        return sub

    def choose(self, key: str, numel: int) -> Tuple[Any, Optional[GradientCompressor]]:
        """(classic compressor class, None) for none/fp16/bf16 tensors, which keep the
        zero-copy paths; (None, stateful compressor) for the others."""
        spec = self.policy.spec_for(key, numel)
        sub = self.compressor(spec)
        if isinstance(sub, ClassicCompressor) and sub is not self._default:
            return sub.compressor, None
        return None, sub

    def bucket_compressor(self):
        """The classic compressor of fused buckets (see ``CompressionPolicy.bucket_spec``)."""
        return self.compressor(self.policy.bucket_spec()).compressor

    def start(self, tensor, name, average, priority, key, timed=False, inplace=False):
        spec = self.policy.spec_for(key, tensor.numel())
        return self.compressor(spec).start(tensor, name, average, priority, key, timed, inplace)

    def state_dict(self):
        return {"policy": repr(self.policy),
                "compressors": {text: sub.state_dict() for text, sub in self._subs.items()
                                if not isinstance(sub, ClassicCompressor)}}

    def load_state_dict(self, state):
        for text, sub_state in state.get("compressors", {}).items():
            self.compressor(parse_compression(text)).load_state_dict(sub_state)

    def __repr__(self) -> str:
        return f"PolicyCompressor({self.policy!r})"


def from_spec(spec: Any) -> GradientCompressor:
    """The torch compressor of a spec (string, dict or CompressionSpec)."""
    from bpstrain.torch.compression import BF16Compressor, FP16Compressor

    spec = parse_compression(spec)
    c = spec.codec
    if c == "none":
        return ClassicCompressor(NoneCompressor, spec)
    if c in ("fp16", "bf16"):
        return ClassicCompressor(FP16Compressor if c == "fp16" else BF16Compressor, spec)
    if c in ("onebit", "topk", "dithering"):
        return ByteCodecCompressor(spec)
    if c == "randomk":
        return RandomKCompressor(spec)
    if c == "powersgd":
        return PowerSGDCompressor(spec)
    return AutoCompressor(spec)


def for_optimizer(compression: Any) -> Optional[PolicyCompressor]:
    """The per-parameter compressor an optimizer owns, or None for a classic compressor
    (``Compression.none``/``fp16``/``bf16`` or a user's compress/decompress class),
    which keeps the optimizer's original path (fused buckets included)."""
    if isinstance(compression, PolicyCompressor):
        return compression.fork()
    if isinstance(compression, GradientCompressor):
        return PolicyCompressor(compression.spec, default=compression.fork())
    if isinstance(compression, (str, dict, CompressionSpec, CompressionPolicy)):
        return PolicyCompressor(compression)
    if hasattr(compression, "compress") and hasattr(compression, "decompress"):
        return None
    if callable(compression):
        raise ValueError("pass a compressor, not its factory: call it, e.g. "
                         f"Compression.topk(0.01). Received: {compression!r}")
    raise ValueError("compression is a Compression member, a spec string such as 'topk:0.01' "
                     f"or a CompressionPolicy. Received: {compression!r}")
