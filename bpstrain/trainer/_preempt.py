"""Checkpoint and requeue on the scheduler's pre-timeout signal (SIGUSR1), mid-epoch.

Lightning's ``SLURMEnvironment`` auto-requeue, for the bpstrain Trainer. When it is on,
``fit`` installs a SIGUSR1 handler that only raises a flag. After every optimizer step
the ranks sum their flags (one 8-byte push_pull), so every rank stops after the *same*
step however the signal reached them (Slurm signals every task, a batch script may
forward it, an admin may signal one process). Then:

1. each rank's own state (torch / CUDA / numpy / Python RNG states, its metric sums of
   the unfinished epoch; the compressors' error feedback, as every checkpoint gathers
   it) goes to rank 0 through the engine (no shared file system needed);
2. rank 0 writes one checkpoint: the usual resume state plus the position inside the
   epoch (epoch, next batch index, global step, the sampler's seed and epoch: the
   shuffle order is a function of them) and those per-rank parts,
   as ``<run>/checkpoints/preempt-<job>.ckpt`` and ``last.ckpt``;
3. after a barrier rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (under Slurm) and every
   rank raises :class:`Preempted` (a ``SystemExit`` with status 0) out of ``fit``.

The next run of the job (the same ``SLURM_JOB_ID``) finds ``preempt-<job>.ckpt`` by itself
(``trainer.resume`` unset; ``trainer.resume=auto`` finds it as ``last.ckpt``), continues in
the same run folder, and starts at the next batch: no step is lost or repeated.

When it is on: ``BPSTRAIN_PREEMPT=auto`` (default) under Slurm (``SLURM_JOB_ID`` set and
``cluster.launcher`` auto or slurm); ``BPSTRAIN_PREEMPT=1`` anywhere (without Slurm the
checkpoint is written and ``fit`` raises :class:`Preempted`, nothing is requeued);
``BPSTRAIN_PREEMPT=0`` never.
"""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from bpstrain.errors import ConfigError
from bpstrain.trainer import _compression_state

ENV = "BPSTRAIN_PREEMPT"
SIGNAL = signal.SIGUSR1


class Preempted(SystemExit):
    """Raised out of ``Trainer.fit`` after the pre-timeout checkpoint (exit status 0).

    Attributes:
        path: The checkpoint written (on rank 0; None on the other ranks).
        requeued: Whether this job was requeued (``scontrol requeue``).
        global_step: The last optimizer step in the checkpoint.
    """

    def __init__(self, path: Optional[Path], requeued: bool, global_step: int):
        super().__init__(0)
        self.path, self.requeued, self.global_step = path, requeued, global_step

    def __str__(self) -> str:
        return (f"preempted after step {self.global_step}: checkpoint "
                f"{self.path or '(written by rank 0)'}"
                + (", job requeued" if self.requeued else ""))


def mode(config: Any, environ: Optional[Mapping[str, str]] = None) -> str:
    """``"off"``, ``"checkpoint"`` (save and stop) or ``"requeue"`` (save, requeue, stop)."""
    environ = os.environ if environ is None else environ
    value = (environ.get(ENV) or "auto").strip().lower()
    launcher = config.cluster.get("launcher", "auto")
    slurm = bool((environ.get("SLURM_JOB_ID") or "").strip()) and launcher in ("auto", "slurm")
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes"):
        return "requeue" if slurm else "checkpoint"
    if value != "auto":
        raise ConfigError(f"environment variable {ENV} must be auto, 1 or 0. "
                          f"Received: {ENV}={value!r}")
    return "requeue" if slurm else "off"


def job_key(environ: Optional[Mapping[str, str]] = None) -> str:
    """What names this job's preemption checkpoint: the Slurm job id, else ``local``."""
    environ = os.environ if environ is None else environ
    return (environ.get("SLURM_JOB_ID") or "").strip() or "local"


def checkpoint_name(environ: Optional[Mapping[str, str]] = None) -> str:
    return f"preempt-{job_key(environ)}.ckpt"


def find_job_checkpoint(out_dir: Any, environ: Optional[Mapping[str, str]] = None
                        ) -> Optional[Path]:
    """This job's preemption checkpoint in any run folder of ``out_dir`` (newest), or None."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return None
    name = checkpoint_name(environ)
    found = [p for p in out_dir.glob(f"*/checkpoints/{name}") if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


class Watch:
    """The SIGUSR1 flag of one ``fit`` and the per-step agreement on it.

    Args:
        trainer: The Trainer (its ``comm`` must be open).
        how: What :func:`mode` said.
    """

    def __init__(self, trainer, how: str):
        self.trainer, self.how = trainer, how
        self.requested = False
        self._previous = None
        self._installed = False

    @property
    def active(self) -> bool:
        return self.how != "off"

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        self.requested = True

    def __enter__(self) -> "Watch":
        if self.active and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(SIGNAL, self._handler)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(SIGNAL, self._previous if self._previous is not None
                          else signal.SIG_DFL)
            self._installed = False

    def should_stop(self) -> bool:
        """Collective: True on every rank when any rank got the signal (call after a step)."""
        if not self.active:
            return False
        flag = np.array([1.0 if self.requested else 0.0])
        return bool(self.trainer.comm.sum(flag, "trainer.preempt.flag")[0] > 0)


# --------------------------------------------------------------------------- per-rank state

def rank_state(trainer) -> Dict[str, Any]:
    """What differs between ranks and a resume must give back to each one."""
    import torch

    state = {"torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(),
             "python_rng": random.getstate(),
             # This rank's metric sums of the unfinished epoch (averaged at its end).
             "train_sums": {k: list(v) for k, v in (trainer.train_sums or {}).items()}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def set_rng(state: Dict[str, Any]) -> None:
    """Puts back the RNG states of :func:`rank_state`."""
    import torch

    torch.set_rng_state(state["torch_rng"])
    np.random.set_state(state["numpy_rng"])
    random.setstate(state["python_rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def _dumps(obj: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(blob: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)


def gather_to_all(comm, obj: Any) -> List[Any]:
    """Every rank's picklable ``obj`` in rank order, on every rank (two push_pulls).

    Each rank puts its bytes at its own offset of a zeroed uint8 buffer; the sum is the
    concatenation (exact: one non-zero summand per byte).
    """
    from bpstrain import engine

    blob = _dumps(obj)
    if not comm.distributed:
        return [obj]
    sizes = np.zeros(comm.size)
    sizes[comm.rank] = len(blob)
    sizes = comm.sum(sizes, "trainer.preempt.sizes").astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    buffer = np.zeros(int(offsets[-1]), np.uint8)
    start = int(offsets[comm.rank])
    buffer[start:start + len(blob)] = np.frombuffer(blob, np.uint8)
    total = engine.push_pull(buffer, name=f"trainer.preempt.parts.{buffer.size}", average=False)
    return [_loads(total[int(offsets[r]):int(offsets[r + 1])].tobytes())
            for r in range(comm.size)]


# ------------------------------------------------------------------------------ save, stop

def save_and_stop(trainer, watch: Watch, epoch: int, next_batch: int, sampler: Any) -> None:
    """Writes the mid-epoch checkpoint, requeues under Slurm, raises :class:`Preempted`."""
    from bpstrain.trainer.callbacks.checkpoint import LAST, checkpoint_dir, write_checkpoint

    parts = gather_to_all(trainer.comm, rank_state(trainer))
    _compression_state.gather(trainer)  # every rank's error feedback (collective)
    path = None
    if trainer.is_global_zero:
        logs, trainer.logs = trainer.logs, {}  # the epoch is not over: not in the history
        try:
            state = trainer.checkpoint_state()
        finally:
            trainer.logs = logs
        state["position"] = {
            "epoch": epoch, "batch": next_batch, "global_step": trainer.global_step,
            "progress_step": trainer.progress_step,
            "logs": dict(trainer.logs),
            "sampler": {"epoch": epoch, "seed": int(getattr(sampler, "seed", 0)),
                        "shuffle": bool(getattr(sampler, "shuffle", False))},
            "size": trainer.size, "ranks": parts,
        }
        folder = checkpoint_dir(trainer.run_dir)
        path = write_checkpoint(state, folder / checkpoint_name())
        write_checkpoint(state, folder / LAST)
    trainer.comm.barrier()  # every rank's part is on disk before anyone requeues
    requeued = False
    # Before the requeue: Slurm ends every process of the job as soon as it takes it.
    trainer.print(f"SIGUSR1: saved {path} at epoch {epoch}, batch {next_batch} "
                  f"(step {trainer.global_step})" + (
                      f"; requeueing job {job_key()}" if watch.how == "requeue" else ""))
    if watch.how == "requeue" and trainer.is_global_zero:
        requeued = requeue()
    raise Preempted(path, requeued, trainer.global_step)


def requeue(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``scontrol requeue $SLURM_JOB_ID`` (the batch job of a heterogeneous step too)."""
    environ = os.environ if environ is None else environ
    job = (environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID")
           and f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}") \
        or environ.get("SLURM_JOB_ID")
    try:
        proc = subprocess.run(["scontrol", "requeue", str(job)], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"[bpstrain] scontrol requeue {job} failed: {exc}", flush=True)
        return False
    if proc.returncode != 0:
        print(f"[bpstrain] scontrol requeue {job} failed (exit {proc.returncode}): "
              f"{proc.stderr.strip()}", flush=True)
        return False
    return True


# ---------------------------------------------------------------------------------- resume

def restore_position(trainer, ckpt: Dict[str, Any]) -> None:
    """Sets the Trainer at the saved position (after ``_restore`` loaded the rest)."""
    position = ckpt.get("position")
    if not position:
        return
    if int(position["size"]) != trainer.size:
        raise ConfigError(
            f"the checkpoint was saved mid-epoch by a job of {position['size']} workers; a "
            f"job of {trainer.size} would shard the data differently and repeat or lose "
            f"samples. Resume with {position['size']} workers. Received: size={trainer.size}")
    trainer.current_epoch = int(position["epoch"])
    trainer.resume_batch = int(position["batch"])
    trainer.global_step = int(position["global_step"])
    trainer.progress_step = int(position.get("progress_step", 0))
    trainer.resume_rank_state = mine = position["ranks"][trainer.rank]
    trainer.resume_sums = {k: list(v) for k, v in mine.get("train_sums", {}).items()}
    trainer.resume_logs = dict(position.get("logs") or {})


def job_resume_path(config: Any, environ: Optional[Mapping[str, str]] = None
                    ) -> Optional[Path]:
    """Under Slurm with the handler on: the checkpoint a requeued run of this job resumes
    from without ``trainer.resume`` (its preemption checkpoint, or that run's newer
    ``last.ckpt``), else None."""
    if mode(config, environ) != "requeue":
        return None
    found = find_job_checkpoint(config.trainer.out_dir, environ)
    if found is None:
        return None
    last = found.with_name("last.ckpt")
    if last.is_file() and last.stat().st_mtime >= found.stat().st_mtime:
        return last
    return found


def job_run_name(config: Any) -> Optional[str]:
    """The run folder a requeued Slurm job continues in (that of its preemption
    checkpoint), else None."""
    if config.trainer.run_name:
        return None
    from bpstrain.trainer._run_dir import run_of_checkpoint

    path = job_resume_path(config)
    return run_of_checkpoint(config.trainer.out_dir, path) if path is not None else None
