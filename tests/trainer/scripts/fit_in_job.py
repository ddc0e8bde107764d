"""One rank of a launched job: the same Trainer.fit, twice; prints what it saw."""

import json
import sys

from bpstrain.trainer import Trainer
from tests.trainer.helpers import base_config, blobs, tiny_net

if __name__ == "__main__":
    out_dir = sys.argv[1]
    x, y = blobs(256)
    results = []
    steps = []
    # A second fit in the same job reuses the running engine; it accumulates gradients.
    for epochs, passes in ((2, 1), (1, 2)):
        trainer = Trainer(base_config(out_dir, **{
            "trainer.epochs": epochs, "trainer.checkpoint_every": 1,
            "optimizer.backward_passes_per_step": passes}))
        history = trainer.fit(tiny_net(), (x, y), val_data=(x, y))
        results.append(history.last)
        steps.append(trainer.global_step)
    print("RESULT " + json.dumps({"rank": trainer.rank, "size": trainer.size,
                                  "last": results, "steps": steps}), flush=True)
