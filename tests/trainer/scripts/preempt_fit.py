"""One rank of a job that SIGUSR1 may interrupt: ``preempt_fit.py OUT_DIR LOG_DIR [resume]``.

Every training step appends ``epoch batch sha1(batch) loss`` to ``LOG_DIR/rank<r>.log``
(the loss after dropout: equal only when weights, optimizer and RNG states are); the
process writes its pid to ``LOG_DIR/rank<r>.pid`` before training. Prints ``RESULT {json}``
when fit completes and ``PREEMPTED {json}`` when SIGUSR1 stopped it (exit status 0 both).
"""

import hashlib
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from bpstrain.trainer import Callback, Preempted, Trainer
from tests.trainer.helpers import base_config, blobs
from tests.result_lines import write_result


class LoggedNet(nn.Module):
    def __init__(self, log: Path):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
        self.log = log

        self.epoch = -1

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        digest = hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:12]
        with open(self.log, "a") as f:
            f.write(f"{self.epoch} {batch_idx} {digest} {loss.item()!r}\n")
        time.sleep(float(os.environ.get("PREEMPT_STEP_SLEEP", "0")))
        return loss


class EpochTag(Callback):
    """Tells the module which epoch it trains (for its log lines)."""

    def on_train_epoch_start(self, trainer, module):
        module.epoch = trainer.current_epoch


if __name__ == "__main__":
    out_dir, log_dir = sys.argv[1], Path(sys.argv[2])
    if "DMLC_WORKER_ID" not in os.environ and "SLURM_PROCID" in os.environ:
        rank = int(os.environ["SLURM_PROCID"])  # a bare srun: the Trainer is the launcher
    else:
        rank = int(os.environ.get("DMLC_WORKER_ID", "0")) * int(os.environ.get(
            "BYTEPS_LOCAL_SIZE", "1")) + int(os.environ.get("BYTEPS_LOCAL_RANK", "0"))
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    x, y = blobs(256)
    extra = {"trainer.epochs": 3, "trainer.batch_size": 8, "trainer.checkpoint_every": 1,
             "trainer.loggers": ["csv"]}
    if len(sys.argv) > 3:
        extra["trainer.resume"] = sys.argv[3]
    trainer = Trainer(base_config(out_dir, **extra), callbacks=[EpochTag()])
    model = LoggedNet(log_dir / f"rank{rank}.log")
    try:
        history = trainer.fit(model, (x, y))
    except Preempted as exc:
        write_result({"rank": trainer.rank, "step": exc.global_step,
                      "path": str(exc.path) if exc.path else None}, "PREEMPTED")
        raise
    weights = hashlib.sha1(b"".join(v.numpy().tobytes() for v in
                                    model.state_dict().values())).hexdigest()
    write_result({
        "rank": trainer.rank, "steps": trainer.global_step, "weights": weights,
        "history": [{k: v for k, v in e.items() if k not in ("samples_per_s", "epoch_time")}
                    for e in history.to_dict()["epochs"]]})
