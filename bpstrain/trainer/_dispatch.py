"""The one place where Trainer events become callback hook calls.

Each event maps to its Lightning-style hook and its Keras-style hook. For every
callback, in list order, the Lightning hook runs first, then the Keras hook, so a
callback early in the list (e.g. MetricAveraging) sees and edits ``logs`` before the
ones after it. Only overridden hooks are called.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Dict, Iterable, Optional, Sequence

from bpstrain.trainer.callbacks.base import Callback

# event -> (Lightning hook name or None, Keras hook name or None)
EVENTS: Dict[str, tuple] = {
    "fit_start": ("on_fit_start", "on_train_begin"),
    "train_start": ("on_train_start", None),
    "train_epoch_start": ("on_train_epoch_start", "on_epoch_begin"),
    "train_batch_start": ("on_train_batch_start", "on_train_batch_begin"),
    "after_backward": ("on_after_backward", None),
    "before_optimizer_step": ("on_before_optimizer_step", None),
    "train_batch_end": ("on_train_batch_end", "on_train_batch_end"),
    "validation_start": ("on_validation_start", "on_test_begin"),
    "validation_batch_end": ("on_validation_batch_end", None),
    "validation_end": ("on_validation_end", "on_test_end"),
    "train_epoch_end": ("on_train_epoch_end", "on_epoch_end"),
    "train_end": ("on_train_end", "on_train_end"),
    "fit_end": ("on_fit_end", None),
    "save_checkpoint": ("on_save_checkpoint", None),
    "load_checkpoint": ("on_load_checkpoint", None),
    "exception": ("on_exception", None),
}

# Hook names used by both APIs with different arguments.
_SHARED = {"on_train_batch_end", "on_train_end"}


@functools.lru_cache(maxsize=None)
def _style(cls: type, hook: str) -> Optional[str]:
    """'lightning', 'keras' or None (not overridden) for ``cls.hook``."""
    method = getattr(cls, hook, None)
    if method is None or method is getattr(Callback, hook, None):
        return None
    if hook not in _SHARED:
        return "any"
    try:
        params = list(inspect.signature(method).parameters.values())[1:]  # drop self
    except (TypeError, ValueError):
        return "keras"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if positional and positional[0].name == "trainer":
        return "lightning"
    required = [p for p in positional if p.default is p.empty]
    return "lightning" if len(required) >= 3 else "keras"


def _lightning_args(event: str, trainer, module, ctx: Dict[str, Any]) -> tuple:
    if event == "train_batch_start":
        return (trainer, module, ctx["batch"], ctx["batch_idx"])
    if event in ("train_batch_end", "validation_batch_end"):
        return (trainer, module, ctx["outputs"], ctx["batch"], ctx["batch_idx"])
    if event == "before_optimizer_step":
        return (trainer, module, ctx["optimizer"])
    if event in ("save_checkpoint", "load_checkpoint"):
        return (trainer, module, ctx["checkpoint"])
    if event == "exception":
        return (trainer, module, ctx["exception"])
    return (trainer, module)


def _keras_args(event: str, ctx: Dict[str, Any]) -> tuple:
    logs = ctx.get("logs")
    if event in ("train_epoch_start", "train_epoch_end"):
        return (ctx["epoch"], logs)
    if event in ("train_batch_start", "train_batch_end"):
        return (ctx["batch_idx"], logs)
    return (logs,)


def fire(callbacks: Sequence[Callback], event: str, trainer=None, module=None,
         **ctx: Any) -> None:
    """Calls every callback's hooks for ``event``.

    Args:
        callbacks: In call order.
        event: A key of :data:`EVENTS`.
        trainer: Passed to Lightning-style hooks.
        module: The model being trained, passed to Lightning-style hooks.
        **ctx: ``logs``, ``epoch``, ``batch``, ``batch_idx``, ``outputs``,
            ``checkpoint``, ``exception`` as the event needs.

    Raises:
        ValueError: An unknown event name.
    """
    if event not in EVENTS:
        raise ValueError(f"Unknown callback event; expected one of {', '.join(EVENTS)}. "
                         f"Received: event={event!r}")
    lightning, keras = EVENTS[event]
    for cb in callbacks:
        cls = type(cb)
        if lightning is not None and _style(cls, lightning) in ("any", "lightning"):
            _call(cb, lightning, _lightning_args(event, trainer, module, ctx), event)
        if keras is not None and _style(cls, keras) in ("any", "keras"):
            _call(cb, keras, _keras_args(event, ctx), event)


def _call(cb: Callback, hook: str, args: tuple, event: str) -> None:
    if event != "exception":
        getattr(cb, hook)(*args)
        return
    try:  # a failing cleanup hook must not hide the error being handled
        getattr(cb, hook)(*args)
    except Exception:  # noqa: BLE001
        pass


def ordered(callbacks: Iterable[Callback]) -> list:
    """Callbacks sorted for dispatch; otherwise the given order is kept.

    Metric averaging goes first (it edits ``logs`` in place and everyone else must
    see averaged values); checkpointing goes last (it saves the others' state).
    """
    callbacks = list(callbacks)
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise TypeError("callbacks must be bpstrain.trainer.Callback instances. "
                            f"Received: {type(cb).__name__}")

    def rank(cb: Callback) -> int:
        return -1 if getattr(cb, "_dispatch_first", False) else int(
            bool(getattr(cb, "_dispatch_last", False)))

    return sorted(callbacks, key=rank)  # stable: equal ranks keep their order
