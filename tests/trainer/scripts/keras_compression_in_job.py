"""One rank of a launched job: a Keras model fit by the Trainer with comm.compression
(top-k by default, onebit on the kernels by rule); prints what it saw."""

import hashlib
import sys

import keras

from bpstrain.trainer import Trainer
from tests.trainer.helpers import base_config, blobs
from tests.result_lines import write_result

if __name__ == "__main__":
    x, y = blobs(256)
    trainer = Trainer(base_config(sys.argv[1], **{
        "trainer.epochs": 3, "comm.compression": "topk:0.25", "comm.compression_min_size": 0,
        "comm.compression_rules": [{"pattern": "*kernel", "compression": "onebit"}]}))
    keras.utils.set_random_seed(trainer.config.trainer.seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4)])
    history = trainer.fit(model, (x, y), val_data=(x, y))
    compression = model.optimizer._bps_compression
    write_result({
        "rank": trainer.rank, "last": history.last,
        "weights": hashlib.sha1(b"".join(w.tobytes() for w in model.get_weights())).hexdigest(),
        "compressor": type(compression).__name__,
        "state": sorted(compression.get_state())})
