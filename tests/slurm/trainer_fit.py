"""``srun python trainer_fit.py OUT``: Trainer.fit with no launcher, each srun task one rank.

cluster.launcher is left at auto, so the Trainer finds the Slurm step itself; prints
``RESULT {json}`` with what this rank saw.
"""

import sys

from bpstrain.trainer import Trainer
from tests.trainer.helpers import base_config, blobs, tiny_net
from tests.result_lines import write_result

if __name__ == "__main__":
    x, y = blobs(256)
    trainer = Trainer(base_config(sys.argv[1], **{"trainer.epochs": 2,
                                                  "trainer.checkpoint_every": 1}))
    history = trainer.fit(tiny_net(), (x, y), val_data=(x, y))
    write_result({"rank": trainer.rank, "size": trainer.size,
                  "steps": trainer.global_step, "run": trainer.run_name,
                  "val_accuracy": history.last["val_accuracy"]})
