"""One worker of the bpstrain.keras test of comm.consistency ssp/async (test_keras.py):
the servers hold the variables and step SGD/Adam; Keras's fit and custom loops take
the weights they answer with. ``BPSTRAIN_CONSISTENCY`` comes from the environment."""

import keras
import numpy as np

import bpstrain.keras as bps
from bpstrain import engine
from keras_worker import rank_data, same_as_rank0, small_model, weights
from launched_job import report_checks  # this script's folder is on sys.path

def fit(r, optimizer, run_eagerly, epochs=3):
    model = small_model(seed=10 + r)  # a different start on every rank: rank 0's wins
    model.compile(optimizer=bps.DistributedOptimizer(optimizer), loss="mse",
                  run_eagerly=run_eagerly)
    start = weights(model.trainable_variables)
    x, y = rank_data(r)
    history = model.fit(x, y, batch_size=16, epochs=epochs, verbose=0)
    return model, start, history.history["loss"]


def check_fit_trains_from_rank_0s_weights(r, n):
    for run_eagerly in (False, True):
        model, _, losses = fit(r, keras.optimizers.SGD(0.02, momentum=0.5), run_eagerly)
        if engine.options()["consistency"] == "ssp:0":  # synchronous: every rank holds the same
            same_as_rank0(weights(model.trainable_variables), f"fit.{run_eagerly}")
        assert losses[-1] < losses[0], losses
        assert engine.stats()["weight_answers"] > 0


def check_lr_0_keeps_rank_0s_initial_weights(r, n):
    model, start, _ = fit(r, keras.optimizers.Adam(0.0), run_eagerly=False, epochs=1)
    rank0 = [engine.broadcast(np.asarray(a), 0, name=f"check.start.{i}") for i, a in enumerate(start)]
    for got, want in zip(weights(model.trainable_variables), rank0):
        np.testing.assert_array_equal(got, want)


def check_unsupported_optimizers_are_refused(r, n):
    for bad in (keras.optimizers.RMSprop(0.1), keras.optimizers.SGD(0.1, weight_decay=0.01)):
        try:
            bps.DistributedOptimizer(bad)
        except ValueError as exc:
            assert "comm.consistency" in str(exc), exc
        else:
            raise AssertionError(f"{type(bad).__name__} was accepted")


CHECKS = [("fit_trains_from_rank_0s_weights", check_fit_trains_from_rank_0s_weights),
          ("lr_0_keeps_rank_0s_initial_weights", check_lr_0_keeps_rank_0s_initial_weights),
          ("unsupported_optimizers_are_refused", check_unsupported_optimizers_are_refused)]


def main():
    bps.init()
    report_checks(CHECKS, bps.rank(), bps.size())
    bps.shutdown()


if __name__ == "__main__":
    main()
