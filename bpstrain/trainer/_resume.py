"""Resuming ``fit`` from a checkpoint: the part torch modules and Keras models share.

Which checkpoint (``trainer.resume``, or a requeued Slurm job's own preemption
checkpoint), read on rank 0 and sent to every rank, and the Trainer's progress put back
(epoch, step, history, callback state, the position inside an interrupted epoch). The
model and optimizer state are framework business: :func:`bpstrain.trainer._loop._restore`
(torch) and :func:`bpstrain.trainer._keras._restore` (Keras) load them in between.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from bpstrain.trainer import _preempt
from bpstrain.trainer._dispatch import fire
from bpstrain.trainer.callbacks.checkpoint import find_last_checkpoint, read_checkpoint
from bpstrain.trainer.history import History


def load(trainer, watch=None) -> Optional[Tuple[str, Dict[str, Any]]]:
    """``(path, checkpoint)`` to resume from, the same on every rank, or None (fresh).

    Rank 0 alone reads, so every rank takes the same decision and the other ranks need
    not see ``out_dir``. Without ``trainer.resume``, a requeued Slurm job resumes from its
    own preemption checkpoint (:mod:`bpstrain.trainer._preempt`) when there is one.
    """
    resume = trainer.config.trainer.resume
    job = not resume and watch is not None and watch.how == "requeue"
    if not resume and not job:
        return None
    loaded = None
    if trainer.rank == 0:
        if job:
            path = _preempt.job_resume_path(trainer.config)
        else:
            path = find_last_checkpoint(trainer.out_dir) if resume == "auto" else resume
        loaded = (str(path), read_checkpoint(path)) if path is not None else None
    loaded = trainer.comm.broadcast_object(loaded, "trainer.resume")
    if loaded is None and not job:
        trainer.print(f"trainer.resume=auto: no checkpoint in {trainer.out_dir}; "
                      "starting fresh")
    return loaded


def restore_progress(trainer, module, path: str, ckpt: Dict[str, Any]) -> None:
    """After the model and optimizers: epoch, step, history, callbacks, mid-epoch position."""
    trainer.resumed = True
    trainer.current_epoch = int(ckpt["epoch"]) + 1
    trainer.global_step = int(ckpt.get("global_step", 0))
    restore_callbacks(trainer, ckpt)
    _preempt.restore_position(trainer, ckpt)  # saved mid-epoch: at the next batch
    fire(trainer.callbacks, "load_checkpoint", trainer, module, checkpoint=ckpt)
    where = f"epoch {trainer.current_epoch}" + (
        f", batch {trainer.resume_batch}" if trainer.resume_batch else "")
    trainer.print(f"resumed from {path} ({where})")


def restore_callbacks(trainer, ckpt: Dict[str, Any]) -> None:
    """The history and every callback's state from a checkpoint's state."""
    trainer.history = History.from_dict(ckpt.get("history", {}))
    states = ckpt.get("callbacks", {})
    for cb in trainer.callbacks:
        if cb.state_key in states:
            cb.load_state_dict(states[cb.state_key])
