"""One rank of a launched job with a Keras model: fit with trainer.precision=16 and
gradient clipping, then validate/test/predict; prints what it saw."""

import hashlib
import sys

import keras
import numpy as np

from bpstrain.keras._optimizer import _DistributedMixin
from bpstrain.trainer import Trainer
from tests.trainer.helpers import base_config, blobs
from tests.result_lines import write_result

if __name__ == "__main__":
    out_dir = sys.argv[1]
    x, y = blobs(256)
    trainer = Trainer(base_config(out_dir, **{"trainer.epochs": 2, "trainer.precision": "16",
                                              "trainer.gradient_clip_val": 1.0}))
    keras.utils.set_random_seed(trainer.config.trainer.seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = trainer.fit(model, (x, y), val_data=(x, y))
    optimizer = model.optimizer
    weights = hashlib.sha1(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()
    # Evaluation in the job (float32): each rank its strided shard, exact over both.
    x_odd, y_odd = x[:255], y[:255]  # uneven shards: 128 and 127 samples
    evaluator = Trainer(base_config(out_dir))
    validated = evaluator.validate(model, (x_odd, y_odd))
    tested = evaluator.test(model, (x_odd, y_odd))
    full = model.evaluate(x_odd, y_odd, verbose=0, return_dict=True)
    predicted = evaluator.predict(model, x_odd)
    write_result({
        "rank": trainer.rank, "size": trainer.size, "last": history.last, "weights": weights,
        "loss_scaled_inside": isinstance(optimizer, _DistributedMixin) and isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer),
        "clip": optimizer.inner_optimizer.global_clipnorm, "validated": validated,
        "tested": tested, "full": full, "predicted": len(predicted)})
