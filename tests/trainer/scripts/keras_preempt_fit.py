"""One rank of a Keras job that SIGUSR1 may interrupt: ``keras_preempt_fit.py OUT LOG [resume]``.

The Keras twin of preempt_fit.py. After every training step it appends ``epoch batch
sha1(all model variables)`` to ``LOG/rank<r>.log``: the weights and the dropout seed
state after the step, equal only when the batches, the optimizer's slots and step count
and the seeds all are. The pid goes to ``LOG/rank<r>.pid`` before training. Prints
``RESULT {json}`` when fit completes, ``PREEMPTED {json}`` when SIGUSR1 stopped it.
"""

import hashlib
import os
import sys
import time
from pathlib import Path

import keras
import numpy as np

from bpstrain.trainer import Callback, Preempted, Trainer
from tests.trainer.helpers import base_config, blobs
from tests.result_lines import write_result


def variables_digest(model) -> str:
    return hashlib.sha1(b"".join(np.asarray(v).tobytes() for v in model.variables)
                        ).hexdigest()[:16]


class StepLog(Callback):
    """Writes one line per training step (and sleeps, so that a signal lands mid-run)."""

    def __init__(self, path: Path):
        self.path = path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        with open(self.path, "a") as f:
            f.write(f"{trainer.current_epoch} {batch_idx} {variables_digest(module)}\n")
        time.sleep(float(os.environ.get("PREEMPT_STEP_SLEEP", "0")))


def make_model(seed: int):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.3), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


if __name__ == "__main__":
    out_dir, log_dir = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ.get("DMLC_WORKER_ID", "0")) * int(os.environ.get(
        "BYTEPS_LOCAL_SIZE", "1")) + int(os.environ.get("BYTEPS_LOCAL_RANK", "0"))
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    x, y = blobs(256)
    extra = {"trainer.epochs": 3, "trainer.batch_size": 8, "trainer.checkpoint_every": 1,
             "trainer.loggers": ["csv"]}
    if len(sys.argv) > 3:
        extra["trainer.resume"] = sys.argv[3]
    trainer = Trainer(base_config(out_dir, **extra),
                      callbacks=[StepLog(log_dir / f"rank{rank}.log")])
    model = make_model(int(trainer.config.trainer.seed))
    try:
        history = trainer.fit(model, (x, y), val_data=(x[:64], y[:64]))
    except Preempted as exc:
        write_result({"rank": trainer.rank, "step": exc.global_step,
                      "path": str(exc.path) if exc.path else None}, "PREEMPTED")
        raise
    write_result({
        "rank": trainer.rank, "steps": trainer.global_step,
        "weights": variables_digest(model),
        "iterations": int(model.optimizer.iterations.numpy()),
        "history": [{k: v for k, v in e.items() if k not in ("samples_per_s", "epoch_time")}
                    for e in history.to_dict()["epochs"]]})
