"""Model checkpoints (rank 0) and finding the last one to resume from.

A checkpoint is one ``torch.save`` file with the model and optimizer state, the
epoch and step counters, the history, every callback's ``state_dict`` and rank 0's
RNG state. Files: ``<dir>/epoch=0003.ckpt`` and a copy ``<dir>/last.ckpt``; with
``save_top_k`` the best k by a monitored metric, ``<dir>/epoch=0003-val_loss=0.1234.ckpt``.
The default ``<dir>`` is ``<run folder>/checkpoints``. Resume with ``trainer.resume=auto``
(the newest ``last.ckpt`` of any run in ``out_dir``) or ``trainer.resume=<path>``.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Union

from bpstrain.trainer.callbacks.base import Callback

LAST = "last.ckpt"


def _gather_compression_state(trainer) -> None:
    # Collective (every rank hands its residuals to rank 0); torch Trainers only.
    if hasattr(trainer, "checkpoint_state") and getattr(trainer, "comm", None) is not None:
        from bpstrain.trainer import _compression_state

        _compression_state.gather(trainer)


def checkpoint_dir(run_dir: Union[str, os.PathLike]) -> Path:
    """Where :class:`ModelCheckpoint` writes by default: ``<run folder>/checkpoints``."""
    return Path(run_dir) / "checkpoints"


def _last_in(folder: Path) -> Optional[Path]:
    if (folder / LAST).is_file():
        return folder / LAST
    epochs = sorted(folder.glob("epoch=*.ckpt")) if folder.is_dir() else []
    return max(epochs, key=lambda p: p.stat().st_mtime) if epochs else None


def find_last_checkpoint(out_dir: Union[str, os.PathLike]) -> Optional[Path]:
    """The checkpoint ``trainer.resume=auto`` continues from, or None.

    Looks at ``<out_dir>/<run>/checkpoints`` of every run (and ``<out_dir>/checkpoints``,
    the layout before run folders); in each, ``last.ckpt`` or else the newest epoch file.
    The most recently written of those wins.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return None
    folders = [checkpoint_dir(out_dir)] + [checkpoint_dir(p) for p in out_dir.iterdir()
                                           if p.is_dir() and p.name != "checkpoints"]
    found = [p for p in (_last_in(f) for f in folders) if p is not None]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def write_checkpoint(state: Dict[str, Any], path: Union[str, os.PathLike]) -> Path:
    """Writes ``state`` with ``torch.save`` atomically (a crash never leaves half a file)."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def read_checkpoint(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """Loads a checkpoint written by :func:`write_checkpoint` onto the CPU.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint not found; expected a file written by "
                                f"ModelCheckpoint. Received: path={str(path)!r}")
    # Our own files: they hold callback state (plain Python objects), not only tensors.
    return torch.load(path, map_location="cpu", weights_only=False)


def monitor_mode(monitor: str, mode: str = "auto") -> str:
    """``"min"`` or ``"max"``; ``"auto"`` is max for accuracy-like names, else min."""
    if mode not in ("min", "max", "auto"):
        raise ValueError(f"mode must be 'min', 'max' or 'auto'. Received: mode={mode!r}")
    if mode != "auto":
        return mode
    return "max" if any(w in monitor for w in ("acc", "auc", "f1", "precision",
                                               "recall")) else "min"


class ModelCheckpoint(Callback):
    """Saves checkpoints every ``every_n_epochs`` epochs and/or the best ``save_top_k``.

    Runs after every other callback, so the saved callback states include this
    epoch's updates (e.g. early stopping's counter). ``last.ckpt`` is always the
    newest checkpoint written (what ``trainer.resume=auto`` continues from).

    Args:
        dirpath: Folder of the files; default ``<run folder>/checkpoints``.
        every_n_epochs: Save period in epochs (>= 1); 0 = only the best ``save_top_k``.
        keep: Keep only the newest ``keep`` periodic files (0 = keep all).
        monitor: Metric of the epoch logs that ranks checkpoints (``save_top_k``).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (max for accuracy-like names).
        save_top_k: Keep the ``k`` best checkpoints by ``monitor``; 0 = off.

    Attributes:
        best_model_path: The best checkpoint so far ("" before one is saved).
        best_model_score: Its ``monitor`` value.
        best_k_models: ``{path: score}`` of the kept best checkpoints.
    """

    _dispatch_last = True
    _monitors_metric = True  # after the module's on_train_epoch_end (Lightning's order)

    def __init__(self, dirpath: Optional[Union[str, os.PathLike]] = None,
                 every_n_epochs: int = 1, keep: int = 0, monitor: str = "val_loss",
                 mode: str = "auto", save_top_k: int = 0):
        if every_n_epochs < 0 or (every_n_epochs == 0 and save_top_k < 1):
            raise ValueError("every_n_epochs must be >= 1 (or 0 with save_top_k >= 1). "
                             f"Received: every_n_epochs={every_n_epochs}, "
                             f"save_top_k={save_top_k}")
        if save_top_k < 0:
            raise ValueError(f"save_top_k must be >= 0. Received: save_top_k={save_top_k}")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.every_n_epochs = every_n_epochs
        self.keep = keep
        self.monitor, self.mode, self.save_top_k = monitor, monitor_mode(monitor, mode), save_top_k
        self.last_path: Optional[Path] = None
        self.best_k_models: Dict[str, float] = {}
        self.best_model_path, self.best_model_score = "", None
        self._saved_epoch = -1
        self._warned = False

    def _folder(self, trainer) -> Path:
        return self.dirpath or checkpoint_dir(trainer.run_dir)

    def _write(self, trainer, name: str) -> Path:
        folder = self._folder(trainer)
        path = write_checkpoint(trainer.checkpoint_state(), folder / name)
        shutil.copyfile(path, folder / (LAST + ".tmp"))
        os.replace(folder / (LAST + ".tmp"), folder / LAST)
        self.last_path, self._saved_epoch = path, trainer.current_epoch
        return path

    def save(self, trainer, module) -> Optional[Path]:
        """Writes a periodic checkpoint of the current state now (rank 0; others: None).

        Every rank must call it at the same point: with ``comm.compression`` each rank's
        error-feedback state is gathered to rank 0 first.
        """
        _gather_compression_state(trainer)
        self._saved_epoch = trainer.current_epoch  # on every rank: on_train_end agrees
        if not trainer.is_global_zero:
            return None
        path = self._write(trainer, f"epoch={trainer.current_epoch:04d}.ckpt")
        if self.keep:
            periodic = [p for p in self._folder(trainer).glob("epoch=*.ckpt")
                        if "-" not in p.stem and str(p) not in self.best_k_models]
            for old in sorted(periodic)[:-self.keep]:
                old.unlink(missing_ok=True)
        return path

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _save_top_k(self, trainer) -> None:
        value = trainer.logs.get(self.monitor)
        if value is None or math.isnan(float(value)):
            if not self._warned and trainer.is_global_zero and not (
                    self.monitor.startswith("val_") and trainer.val_sums is None):
                warnings.warn(f"ModelCheckpoint: metric {self.monitor!r} is not in the epoch "
                              f"logs (available: {', '.join(trainer.logs)}); this epoch is not "
                              f"ranked. Received: monitor={self.monitor!r}", stacklevel=2)
                self._warned = True
            return  # e.g. an epoch without validation
        value = float(value)
        worst = (max if self.mode == "min" else min)(self.best_k_models.values(), default=None)
        if len(self.best_k_models) >= self.save_top_k and not self._better(value, worst):
            return
        # Every rank tracks the ranking (metrics are averaged, so it is the same); rank 0
        # writes. The ranking is updated first so the checkpoint's own state includes it.
        name = f"epoch={trainer.current_epoch:04d}-{self.monitor}={value:.4f}.ckpt"
        path = str(self._folder(trainer) / name)
        self.best_k_models[path] = value
        drop = None
        if len(self.best_k_models) > self.save_top_k:
            drop = next(p for p, v in self.best_k_models.items() if v == worst)
            del self.best_k_models[drop]
        best = (min if self.mode == "min" else max)(self.best_k_models.values())
        self.best_model_path = next(p for p, v in self.best_k_models.items() if v == best)
        self.best_model_score = best
        _gather_compression_state(trainer)
        self._saved_epoch = trainer.current_epoch
        if trainer.is_global_zero:
            self._write(trainer, name)
            if drop is not None:
                Path(drop).unlink(missing_ok=True)

    def on_train_epoch_end(self, trainer, module) -> None:
        if self.save_top_k:
            self._save_top_k(trainer)
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer, module)

    def on_train_end(self, trainer, module) -> None:
        if self._saved_epoch != trainer.current_epoch and trainer.epochs_completed > 0:
            self.save(trainer, module)

    def state_dict(self) -> Dict[str, Any]:
        return {"last_path": str(self.last_path) if self.last_path else None,
                "best_k_models": dict(self.best_k_models),
                "best_model_path": self.best_model_path,
                "best_model_score": self.best_model_score}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.last_path = Path(state["last_path"]) if state.get("last_path") else None
        self.best_k_models = dict(state.get("best_k_models", {}))
        self.best_model_path = state.get("best_model_path", "")
        self.best_model_score = state.get("best_model_score")
