"""One rank of a launched Trainer job with comm.fault_tolerance in which a worker joins
while it trains (test_launched.py). ``kill``: rank 2 SIGKILLs itself at global step AT
of its first life and the launcher (``--max-restarts 1``) starts it again; ``scale-up``:
rank 0 starts a third worker by hand at step AT (no DMLC_WORKER_ID, under
BPSTRAIN_MAX_WORKERS=3). Either joins at the next admission, gets the others' state and
trains to the end. Every worker prints one RESULT line; SeenSamples records what each
trained (argv: out_dir, mode)."""

import os
import signal
import subprocess
import sys
import time

import torch

from bpstrain import engine
from bpstrain.trainer import Callback, Trainer
from tests.trainer.helpers import SeenSamples, base_config, blobs, tiny_net
from tests.result_lines import write_result

AT = 3


class Fault(Callback):
    def __init__(self, mode, marker):
        self.mode, self.marker, self.started = mode, marker, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        me = engine.membership()["rendezvous_rank"]
        if trainer.global_step != AT or engine.membership()["admitted_late"]:
            return
        if self.mode == "kill" and me == 2 and not os.environ.get("BPSTRAIN_RESTART"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "scale-up" and me == 0 and self.started is None:
            env = {k: v for k, v in os.environ.items() if k not in ("DMLC_WORKER_ID", "BPSTRAIN_HOST_ID")}
            self.started = subprocess.Popen([sys.executable, *sys.argv], env=env)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        # The steps take milliseconds and a new process seconds to start. ``kill``: the
        # two in the job wait at the last batch of epoch 0 until the restarted process is
        # about to join, which it then does at that batch's end, right before the epoch's
        # end (where it has trained no batch of the epoch); ``scale-up``: they slow down
        # until it joined, which it does mid-epoch.
        if trainer.size >= 3 or trainer.global_step <= AT:
            return
        if self.mode == "scale-up":
            time.sleep(0.25)
        elif trainer.current_epoch == 0 and batch_idx == trainer.num_training_batches - 1:
            deadline = time.monotonic() + 90
            while not os.path.exists(self.marker) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(3)  # its import is over; its registration takes less


if __name__ == "__main__":
    out_dir, mode = sys.argv[1], sys.argv[2]
    x, y = blobs(384)
    seen = os.path.join(out_dir, "seen")
    os.makedirs(seen, exist_ok=True)
    marker = os.path.join(out_dir, "restarted")
    if os.environ.get("BPSTRAIN_RESTART"):
        open(marker, "w").close()
    fault = Fault(mode, marker)
    trainer = Trainer(base_config(out_dir, **{
        "trainer.epochs": 3, "trainer.run_name": "run", "trainer.checkpoint_every": 1,
        "comm.fault_tolerance": True}), callbacks=[fault, SeenSamples(seen)])
    model = tiny_net()
    history = trainer.fit(model, (x, y))
    m = engine.membership() if engine.is_initialized() else {}
    write_result({
        "rank": m.get("rendezvous_rank"), "size": trainer.size, "admitted_late": m.get("admitted_late"),
        "restarted": os.environ.get("BPSTRAIN_RESTART"), "steps": trainer.global_step,
        "epochs": [e["epoch"] for e in history.epochs], "loss": history["loss"],
        "weights": [p.detach().reshape(-1).tolist() for p in model.state_dict().values()]})
    if fault.started is not None:
        fault.started.wait(60)
