"""The one callback base class: Lightning-style and Keras-style hooks side by side.

Override whichever hooks you like; the Trainer calls each event's Lightning hook
first, then its Keras hook (see :mod:`bpstrain.trainer._dispatch`). Some names exist
in both APIs with different arguments (``on_train_batch_end``, ``on_train_end``,
``on_test_end``, ...); the dispatcher tells them apart by the override's signature:

    class Lightningish(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx): ...

    class Kerasish(Callback):
        def on_train_batch_end(self, batch, logs=None): ...

A hook whose first parameter is named ``trainer`` (or that takes three or more
positional parameters) is Lightning-style; otherwise it is Keras-style.

Callbacks run on every rank; use ``trainer.is_global_zero`` for rank-0-only work.
Whatever :meth:`Callback.state_dict` returns is stored in checkpoints and handed
back to :meth:`Callback.load_state_dict` on resume.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

Logs = Optional[Dict[str, Any]]


class Callback:
    """Base class of every Trainer callback; all hooks do nothing by default."""

    # ------------------------------------------------------------------ identity / state

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint; unique per class by default."""
        return type(self).__qualname__

    def state_dict(self) -> Dict[str, Any]:
        """What to save in a checkpoint (picklable); empty by default."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned (called on resume, before ``on_fit_start``)."""
        del state

    # ----------------------------------------------------------------- Lightning-style hooks

    def on_fit_start(self, trainer, module) -> None:
        """Model, optimizer and engine are ready (parameters already broadcast)."""

    def on_fit_end(self, trainer, module) -> None:
        """Training finished normally (also after early stopping)."""

    def on_train_start(self, trainer, module) -> None:
        """Right before the first training epoch."""

    def on_train_epoch_start(self, trainer, module) -> None:
        """An epoch begins; ``trainer.current_epoch`` is its 0-based index."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx: int) -> None:
        """Before the forward pass of a training batch."""

    def on_after_backward(self, trainer, module) -> None:
        """After ``loss.backward()`` of a batch: this rank's own (not yet averaged, and with
        ``trainer.precision=16`` still scaled) gradients are in ``p.grad``."""

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        """Right before ``optimizer.step()``: gradients are averaged over ranks and
        unscaled; gradient clipping (``trainer.gradient_clip_val``) comes after this."""

    def on_train_batch_end(self, *args, **kwargs) -> None:
        """After a training step.

        Lightning-style: ``(trainer, module, outputs, batch, batch_idx)`` where
        ``outputs`` is ``{"loss": float, ...}``. Keras-style: ``(batch, logs)``.
        """

    def on_train_epoch_end(self, trainer, module) -> None:
        """After training and validation of an epoch; ``trainer.logs`` holds its metrics."""

    def on_validation_start(self, trainer, module) -> None:
        """Before the validation pass of an epoch."""

    def on_validation_epoch_start(self, trainer, module) -> None:
        """After ``on_validation_start``, before the first validation batch."""

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx: int) -> None:
        """After one validation batch."""

    def on_validation_epoch_end(self, trainer, module) -> None:
        """After the last validation batch; ``trainer.logs`` has the ``val_*`` metrics,
        averaged over ranks (MetricAveraging runs first)."""

    def on_validation_end(self, trainer, module) -> None:
        """After validation; ``trainer.logs`` has the (averaged) ``val_*`` metrics."""

    def on_test_start(self, trainer, module) -> None:
        """``Trainer.test`` begins."""

    def on_test_epoch_start(self, trainer, module) -> None:
        """Before the first test batch."""

    def on_test_batch_end(self, *args, **kwargs) -> None:
        """Lightning-style ``(trainer, module, outputs, batch, batch_idx)``: after one test
        batch. (Keras' ``(batch, logs)`` form is never called.)"""

    def on_test_epoch_end(self, trainer, module) -> None:
        """After the last test batch; ``trainer.logs`` has the averaged ``test_*`` metrics."""

    def on_predict_start(self, trainer, module) -> None:
        """``Trainer.predict`` begins."""

    def on_predict_end(self, *args, **kwargs) -> None:
        """Lightning-style ``(trainer, module)``: ``Trainer.predict`` ended. (Keras'
        ``(logs)`` form is never called.)"""

    def on_save_checkpoint(self, trainer, module, checkpoint: Dict[str, Any]) -> None:
        """A checkpoint dict is about to be written; add entries to it here."""

    def on_load_checkpoint(self, trainer, module, checkpoint: Dict[str, Any]) -> None:
        """A checkpoint was loaded for resume."""

    def on_exception(self, trainer, module, exception: BaseException) -> None:
        """Training raised (KeyboardInterrupt included); clean up resources here."""

    # --------------------------------------------------------------------- Keras-style hooks

    def on_train_begin(self, logs: Logs = None) -> None:
        """Keras: training begins (after the model is built and broadcast)."""

    def on_train_end(self, *args, **kwargs) -> None:
        """Keras ``(logs)``; Lightning ``(trainer, module)``: training has ended."""

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        """Keras: epoch ``epoch`` (0-based) begins."""

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        """Keras: epoch ended; ``logs`` has ``loss``, ``val_loss``, ... (mutable)."""

    def on_train_batch_begin(self, batch: int, logs: Logs = None) -> None:
        """Keras: a training batch begins."""

    def on_test_begin(self, logs: Logs = None) -> None:
        """Keras: validation begins."""

    def on_test_end(self, *args, **kwargs) -> None:
        """Keras ``(logs)``: validation during ``fit`` ended; Lightning ``(trainer,
        module)``: ``Trainer.test`` ended."""
