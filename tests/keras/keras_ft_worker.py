"""A worker of the Keras fault-tolerance test (test_keras.py): ``model.fit`` of a linear
model with bpstrain.keras.DistributedOptimizer; rank 2 kills itself (SIGKILL) when batch
AT begins. Survivors print ``FT_RESULT {json}`` with the final kernel and how many steps
the optimizer took."""

import os
import signal

import keras
import numpy as np

import bpstrain.keras as bps
from tests.result_lines import write_result

STEPS, AT, BATCH, LR = 8, 3, 16, 0.05


def rank_data(rank):
    rng = np.random.default_rng(50 + rank)
    x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
    return x, (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32"))[:, None]


def report_and_shut_down(model, **extra):
    """Prints ``FT_RESULT {json}``: ``extra``, the job's size, the final kernel and how many
    steps the optimizer took; then leaves the job."""
    write_result({
        **extra, "size": bps.size(), "kernel": keras.ops.convert_to_numpy(model.layers[0].kernel).ravel().tolist(),
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations))}, "FT_RESULT")
    bps.shutdown()


class KillAt(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if bps.rank() == 2 and batch == AT:
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    bps.init()
    me = bps.rank()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    x, y = rank_data(me)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[KillAt()])
    report_and_shut_down(model, rank=me)


if __name__ == "__main__":
    main()
