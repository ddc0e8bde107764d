"""Small models, data and callbacks shared by the Trainer tests (importable by workers)."""

from __future__ import annotations

import os
import signal

import numpy as np
import torch
from torch import nn

from bpstrain.trainer import Callback


def blobs(n: int = 256, seed: int = 0):
    """A linearly separable 4-class problem: (x float32 [n, 8], y int64 [n])."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    centers = rng.normal(0, 3, (4, 8))
    x = centers[y] + rng.normal(0, 0.5, (n, 8))
    return x.astype(np.float32), y.astype(np.int64)


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def base_config(tmp_path, **extra):
    cfg = {"trainer.epochs": 2, "trainer.batch_size": 32, "trainer.out_dir": str(tmp_path),
           "trainer.progress": False, "optimizer.name": "adam", "optimizer.lr": 0.01}
    cfg.update(extra)
    return cfg


class StepModule(nn.Module):
    """A module with Lightning-style training_step/validation_step."""

    def __init__(self):
        super().__init__()
        self.net = tiny_net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        return {"loss": nn.functional.cross_entropy(out, y),
                "acc": (out.argmax(1) == y).float().mean()}

    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)


class FailingModule(StepModule):
    """Raises ValueError in training_step on rank ``fail_rank`` at ``fail_batch``."""

    def __init__(self, fail_rank: int = 1, fail_batch: int = 2):
        super().__init__()
        self.fail_rank, self.fail_batch = fail_rank, fail_batch

    def training_step(self, batch, batch_idx):
        from bpstrain import engine

        if engine.rank() == self.fail_rank and batch_idx == self.fail_batch:
            print(f"about to fail on rank {self.fail_rank}")
            raise ValueError(f"boom on rank {self.fail_rank} at batch {batch_idx}")
        return super().training_step(batch, batch_idx)


class InterruptParent(Callback):
    """On rank 0, sends SIGINT to the parent once (what Ctrl-C in a notebook does)."""

    def __init__(self, at_batch: int = 2):
        self.at_batch = at_batch
        self.sent = False

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.is_global_zero and not self.sent and batch_idx == self.at_batch:
            self.sent = True
            os.kill(os.getppid(), signal.SIGINT)


class ExitWorker(Callback):
    """Rank ``rank`` exits abruptly (as if killed) at its first batch."""

    def __init__(self, rank: int = 1):
        self.rank = rank

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        # Only at the job's first batch: with fault tolerance the ranks are renumbered after
        # it left, and another worker then holds this rank.
        if trainer.rank == self.rank and trainer.global_step == 0 and batch_idx == 0:
            os._exit(3)


class DieWritingCheckpoint(Callback):
    """Rank 0 dies (exit 3) in the middle of its first checkpoint write: half the file's
    bytes are on disk, under the temporary name the writer renames when done."""

    def on_fit_start(self, trainer, module):
        if trainer.rank != 0:
            return
        import io

        real = torch.save

        def dying_save(obj, f, *args, **kwargs):
            buf = io.BytesIO()
            real(obj, buf, *args, **kwargs)
            with open(f, "wb") as out:
                out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            os._exit(3)

        torch.save = dying_save


class SeenSamples(Callback):
    """Appends ``epoch x0 x1`` per trained sample to ``folder/seen-<pid>`` (which samples
    each worker trained on, identified by their first two features)."""

    def __init__(self, folder):
        self.folder = str(folder)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        with open(os.path.join(self.folder, f"seen-{os.getpid()}"), "a") as f:
            for row in batch[0].cpu().numpy():
                f.write(f"{trainer.current_epoch} {row[0]:.5f} {row[1]:.5f}\n")


class Recorder(Callback):
    """Records every hook call it gets (both styles) and keeps a counter as state."""

    def __init__(self):
        self.calls = []
        self.epochs_seen = 0

    def on_fit_start(self, trainer, module):
        self.calls.append("on_fit_start")

    def on_train_begin(self, logs=None):
        self.calls.append("on_train_begin")

    def on_train_epoch_start(self, trainer, module):
        self.calls.append("on_train_epoch_start")

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(f"on_epoch_begin:{epoch}")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 0:
            self.calls.append(f"on_train_batch_end:{sorted(outputs)}")

    def on_validation_end(self, trainer, module):
        self.calls.append("on_validation_end")

    def on_train_epoch_end(self, trainer, module):
        self.calls.append("on_train_epoch_end")
        self.epochs_seen += 1

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(f"on_epoch_end:{epoch}:{'val_loss' in logs}")

    def on_train_end(self, logs=None):
        self.calls.append("on_train_end")

    def on_fit_end(self, trainer, module):
        self.calls.append("on_fit_end")

    def state_dict(self):
        return {"epochs_seen": self.epochs_seen}

    def load_state_dict(self, state):
        self.epochs_seen = state["epochs_seen"]


class KerasBatchEnd(Callback):
    """Keras-style on_train_batch_end(batch, logs)."""

    def __init__(self):
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((batch, sorted(logs)))


def tensor_total(state) -> float:
    """Sum of |x| over every tensor or array nested in ``state`` (dicts, lists)."""
    if isinstance(state, dict):
        return sum(tensor_total(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_total(v) for v in state)
    if isinstance(state, torch.Tensor):
        return float(state.detach().abs().sum())
    if isinstance(state, np.ndarray):
        return float(np.abs(state).sum())
    return 0.0


class CompressionProbe(Callback):
    """Records, per rank, the size of the optimizer's compression state at fit start
    (after a resume restored it) and at the end of every epoch."""

    def __init__(self):
        self.at_start = None
        self.at_epoch_end = []

    def _total(self, trainer):
        return tensor_total(trainer.optimizer.state_dict().get("bpstrain_compression"))

    def on_train_start(self, trainer, module):
        self.at_start = self._total(trainer)

    def on_train_epoch_end(self, trainer, module):
        self.at_epoch_end.append(self._total(trainer))

    def state_dict(self):
        return {"at_start": self.at_start, "at_epoch_end": self.at_epoch_end}

    def load_state_dict(self, state):
        self.at_start, self.at_epoch_end = state["at_start"], state["at_epoch_end"]


class ExitAndRejoin(Callback):
    """comm.fault_tolerance with restarts: the worker of rendezvous rank ``rank`` exits
    abruptly (as if killed) at global step ``step`` of its first life; the restarted
    process leaves ``marker`` when it is unpickled (before its engine starts). The
    workers in the job wait at the last batch of epoch 0 until that marker is there (and
    3 s more, for its registration), then go on slowly until it joined, so that it joins
    at that batch's end (or soon after)."""

    def __init__(self, marker, rank: int = 2, step: int = 2):
        self.marker, self.rank, self.step = str(marker), rank, step

    def __setstate__(self, state):
        self.__dict__.update(state)
        if os.environ.get("BPSTRAIN_RESTART"):
            open(self.marker, "w").close()

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        from bpstrain import engine

        if (engine.membership()["rendezvous_rank"] == self.rank and trainer.global_step == self.step
                and not os.environ.get("BPSTRAIN_RESTART")):
            os._exit(3)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        import time

        if trainer.global_step <= self.step or trainer.size >= 3:
            return
        if trainer.current_epoch == 0 and batch_idx == trainer.num_training_batches - 1:
            deadline = time.monotonic() + 90
            while not os.path.exists(self.marker) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(3)
        else:
            time.sleep(0.25)


def send_messages(outbox, count: int) -> None:
    """A worker-process target: ``count`` whole messages to the parent, then a clean exit."""
    for i in range(count):
        outbox.put(("print", 1, "stdout", f"line {i}"))
    outbox.close()


def send_then_die_mid_message(outbox) -> None:
    """A worker-process target: one whole message, then the first bytes of one that says
    it is 1,000 bytes long, then death (as a SIGKILL mid-``put`` leaves a pipe)."""
    import struct

    outbox.put(("print", 0, "stdout", "whole"))
    os.write(outbox._conn.fileno(), struct.pack("!i", 1000) + b"cut short")
    os._exit(3)
