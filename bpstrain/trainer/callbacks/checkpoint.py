"""Model checkpoints (rank 0) and finding the last one to resume from.

A checkpoint is one ``torch.save`` file with the model and optimizer state, the
epoch and step counters, the history, every callback's ``state_dict`` and rank 0's
RNG state. Files: ``<dir>/epoch=0003.ckpt`` and a copy ``<dir>/last.ckpt``.
Resume with ``trainer.resume=auto`` (the last one in ``<out_dir>/checkpoints``) or
``trainer.resume=<path>``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Union

from bpstrain.trainer.callbacks.base import Callback

LAST = "last.ckpt"


def checkpoint_dir(out_dir: Union[str, os.PathLike]) -> Path:
    """Where :class:`ModelCheckpoint` writes by default: ``<out_dir>/checkpoints``."""
    return Path(out_dir) / "checkpoints"


def find_last_checkpoint(out_dir: Union[str, os.PathLike]) -> Optional[Path]:
    """``<out_dir>/checkpoints/last.ckpt`` if it exists, else the newest epoch file, else None."""
    folder = checkpoint_dir(out_dir)
    if (folder / LAST).is_file():
        return folder / LAST
    epochs = sorted(folder.glob("epoch=*.ckpt")) if folder.is_dir() else []
    return epochs[-1] if epochs else None


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


class ModelCheckpoint(Callback):
    """Saves a checkpoint every ``every_n_epochs`` epochs and at the end of training.

    Runs after every other callback, so the saved callback states include this
    epoch's updates (e.g. early stopping's counter).

    Args:
        dirpath: Folder of the files; default ``<trainer.out_dir>/checkpoints``.
        every_n_epochs: Save period in epochs (>= 1).
        keep: Keep only the newest ``keep`` epoch files (0 = keep all).
    """

    _dispatch_last = True

    def __init__(self, dirpath: Optional[Union[str, os.PathLike]] = None,
                 every_n_epochs: int = 1, keep: int = 0):
        if every_n_epochs < 1:
            raise ValueError("every_n_epochs must be >= 1. "
                             f"Received: every_n_epochs={every_n_epochs}")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.every_n_epochs = every_n_epochs
        self.keep = keep
        self.last_path: Optional[Path] = None
        self._saved_epoch = -1

    def _folder(self, trainer) -> Path:
        return self.dirpath or checkpoint_dir(trainer.out_dir)

    def save(self, trainer, module) -> Optional[Path]:
        """Writes a checkpoint of the current state now (rank 0 only; others return None)."""
        if not trainer.is_global_zero:
            return None
        state = trainer.checkpoint_state()
        folder = self._folder(trainer)
        path = write_checkpoint(state, folder / f"epoch={trainer.current_epoch:04d}.ckpt")
        shutil.copyfile(path, folder / (LAST + ".tmp"))
        os.replace(folder / (LAST + ".tmp"), folder / LAST)
        self.last_path, self._saved_epoch = path, trainer.current_epoch
        if self.keep:
            for old in sorted(folder.glob("epoch=*.ckpt"))[:-self.keep]:
                old.unlink(missing_ok=True)
        return path

    def on_train_epoch_end(self, trainer, module) -> None:
        if (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer, module)

    def on_train_end(self, trainer, module) -> None:
        if self._saved_epoch != trainer.current_epoch and trainer.epochs_completed > 0:
            self.save(trainer, module)

    def state_dict(self) -> Dict[str, Any]:
        return {"last_path": str(self.last_path) if self.last_path else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.last_path = Path(state["last_path"]) if state.get("last_path") else None
