"""One rank of a launched job: the same Trainer.fit, twice; prints what it saw."""

import sys

import torch

from bpstrain.trainer import Trainer
from tests.trainer.helpers import base_config, blobs, tiny_net
from tests.result_lines import write_result

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
        model = tiny_net()
        history = trainer.fit(model, (x, y), val_data=(x, y))
        results.append(history.last)
        steps.append(trainer.global_step)
    # Evaluation in the job: each rank its strided shard, metrics exact over both.
    x_odd, y_odd = x[:255], y[:255]  # uneven shards: 128 and 127 samples
    validated = trainer.validate(model, (x_odd, y_odd))
    tested = trainer.test(model, (x_odd, y_odd))
    with torch.no_grad():
        full = torch.nn.functional.cross_entropy(model(torch.as_tensor(x_odd)),
                                                 torch.as_tensor(y_odd)).item()
    predicted = torch.cat(trainer.predict(model, x_odd))
    write_result({"rank": trainer.rank, "size": trainer.size,
                  "last": results, "steps": steps, "validated": validated,
                  "tested": tested, "full_loss": full,
                  "predicted": len(predicted)})
