"""The one place where Trainer events become callback hook calls.

Each event maps to its Lightning-style hook and its Keras-style hook. For every
callback, in list order, the Lightning hook runs first, then the Keras hook, so a
callback early in the list (e.g. MetricAveraging) sees and edits ``logs`` before the
ones after it. Only overridden hooks are called.

A torch module's own hooks of the same name (``on_train_epoch_end(self)``,
``on_after_backward(self)``, ``on_before_optimizer_step(self, optimizer)``, ...) are
called too, with Lightning's arguments and in Lightning's order: after the callbacks,
except at ``on_train_epoch_end``, where the module comes before the callbacks that
monitor a metric (EarlyStopping, ModelCheckpoint) so they see what it put in the logs.
``on_load_checkpoint`` of the module is called by the resume code itself, before the
weights are loaded (Lightning's order).
"""

from __future__ import annotations

import functools
import inspect
import sys
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
    "validation_epoch_start": ("on_validation_epoch_start", None),
    "validation_batch_end": ("on_validation_batch_end", None),
    "validation_epoch_end": ("on_validation_epoch_end", None),
    "validation_end": ("on_validation_end", "on_test_end"),
    "train_epoch_end": ("on_train_epoch_end", "on_epoch_end"),
    "train_end": ("on_train_end", "on_train_end"),
    "fit_end": ("on_fit_end", None),
    "save_checkpoint": ("on_save_checkpoint", None),
    "load_checkpoint": ("on_load_checkpoint", None),
    "exception": ("on_exception", None),
    "test_start": ("on_test_start", None),
    "test_epoch_start": ("on_test_epoch_start", None),
    "test_batch_end": ("on_test_batch_end", None),
    "test_epoch_end": ("on_test_epoch_end", None),
    "test_end": ("on_test_end", None),
    "predict_start": ("on_predict_start", None),
    "predict_end": ("on_predict_end", None),
}

# Hook names used by both APIs with different arguments.
_SHARED = {"on_train_batch_end", "on_train_end", "on_test_end", "on_test_batch_end",
           "on_predict_end"}

# Events without a LightningModule hook (or whose module hook the caller runs itself).
_NO_MODULE_HOOK = {"exception", "load_checkpoint"}


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
    if event in ("train_batch_end", "validation_batch_end", "test_batch_end"):
        return (trainer, module, ctx["outputs"], ctx["batch"], ctx["batch_idx"])
    if event == "before_optimizer_step":
        return (trainer, module, ctx["optimizer"])
    if event in ("save_checkpoint", "load_checkpoint"):
        return (trainer, module, ctx["checkpoint"])
    if event == "exception":
        return (trainer, module, ctx["exception"])
    return (trainer, module)


def _module_args(event: str, ctx: Dict[str, Any]) -> tuple:
    """Arguments of a LightningModule's own hook (no trainer, no module)."""
    if event == "train_batch_start":
        return (ctx["batch"], ctx["batch_idx"])
    if event in ("train_batch_end", "validation_batch_end", "test_batch_end"):
        return (ctx["outputs"], ctx["batch"], ctx["batch_idx"])
    if event == "before_optimizer_step":
        return (ctx["optimizer"],)
    if event == "save_checkpoint":
        return (ctx["checkpoint"],)
    return ()


def module_hook(module: Any, hook: str) -> Optional[Any]:
    """``module.<hook>`` when ``module`` is a torch module that defines it, else None.

    Keras models and everything else are left alone: their methods of these names (if
    any) are not Lightning hooks.
    """
    torch = sys.modules.get("torch")
    if module is None or torch is None or not isinstance(module, torch.nn.Module):
        return None
    method = getattr(module, hook, None)
    return method if callable(method) else None


def _monitors(cb: Callback) -> bool:
    """Lightning's "monitoring callbacks" (EarlyStopping, checkpointing)."""
    return bool(getattr(cb, "_monitors_metric", False))


def _keras_args(event: str, ctx: Dict[str, Any]) -> tuple:
    logs = ctx.get("logs")
    if event in ("train_epoch_start", "train_epoch_end"):
        return (ctx["epoch"], logs)
    if event in ("train_batch_start", "train_batch_end"):
        return (ctx["batch_idx"], logs)
    return (logs,)


def fire(callbacks: Sequence[Callback], event: str, trainer=None, module=None,
         **ctx: Any) -> Any:
    """Calls every callback's hooks for ``event``, then the module's own hook.

    Args:
        callbacks: In call order.
        event: A key of :data:`EVENTS`.
        trainer: Passed to Lightning-style hooks.
        module: The model being trained, passed to Lightning-style hooks.
        **ctx: ``logs``, ``epoch``, ``batch``, ``batch_idx``, ``outputs``,
            ``checkpoint``, ``exception`` as the event needs.

    Returns:
        What the module's hook returned (None without one).

    Raises:
        ValueError: An unknown event name.
    """
    if event not in EVENTS:
        raise ValueError(f"Unknown callback event; expected one of {', '.join(EVENTS)}. "
                         f"Received: event={event!r}")
    lightning = EVENTS[event][0]
    hook = None if event in _NO_MODULE_HOOK else module_hook(module, lightning)
    later = []
    if hook is not None and event == "train_epoch_end":
        later = [cb for cb in callbacks if _monitors(cb)]
        callbacks = [cb for cb in callbacks if not _monitors(cb)]
    _fire_callbacks(callbacks, event, trainer, module, ctx)
    result = hook(*_module_args(event, ctx)) if hook is not None else None
    _fire_callbacks(later, event, trainer, module, ctx)
    return result


def _fire_callbacks(callbacks: Sequence[Callback], event: str, trainer, module,
                    ctx: Dict[str, Any]) -> None:
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
