"""A worker of the Keras join test (test_keras.py): ``bpstrain.keras.elastic.fit`` of a
linear model for EPOCHS epochs with a KerasState committed after every batch; rank 2
kills itself (SIGKILL) when batch AT of epoch 0 begins, the launcher (``--max-restarts
1``) starts it again, and it joins at a commit (the others wait at batch AT + 2's until
it has) with the others' weights, optimizer variables and position. Every worker prints ``FT_RESULT {json}``."""

import os
import signal
import time

import keras
import numpy as np

import bpstrain.keras as bps
from bpstrain import engine
from keras_ft_worker import AT, BATCH, LR, rank_data, report_and_shut_down

EPOCHS = 2


class Fault(keras.callbacks.Callback):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_begin(self, batch, logs=None):
        if bps.rank() == 2 and self.state.epoch == 0 and batch == AT and not os.environ.get("BPSTRAIN_RESTART"):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, batch, logs=None):
        # A new process takes seconds to start (TensorFlow), a step milliseconds: the two
        # in the job wait at batch AT + 2 of epoch 0, committing (an admission each time,
        # on both at once), until it joined there or earlier.
        deadline = time.monotonic() + 120
        while self.state.epoch == 0 and batch == AT + 2 and bps.size() < 3:
            assert time.monotonic() < deadline, "the restarted worker never joined"
            time.sleep(0.1)
            self.state.commit()


def main():
    bps.init()
    me = engine.membership()["rendezvous_rank"]  # what the data follows (rank() renumbers)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.5)), loss="mse")
    state = bps.elastic.KerasState(model)
    state.sync()
    start = [state.epoch, state.batch]
    x, y = rank_data(me)
    bps.elastic.fit(state, model, x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
                    callbacks=[bps.elastic.CommitStateCallback(state), Fault(state)])
    report_and_shut_down(model, rank=me, start=start, restarted=os.environ.get("BPSTRAIN_RESTART"))


if __name__ == "__main__":
    main()
