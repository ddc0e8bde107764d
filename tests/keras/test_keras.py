"""bpstrain.keras: real 2-worker jobs on both Keras backends, plus in-process unit tests.

Each backend runs one launched job (keras_worker.py) holding every check, because each
worker pays the backend import; the tests here report the checks one by one.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

from tests.result_lines import read_results

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from launched_job import assert_check, launch  # noqa: E402

BACKENDS = ["tensorflow", "torch"]
CHECKS = ["helpers", "bytepscallback_fit", "separate_callbacks_fit", "aggregation_sum",
          "aggregation_average", "aggregation_run_eagerly", "misuse", "xla_switched_off",
          "lazy_model_broadcast", "tensorflow_keras_module", "keras_compression",
          "keras_sparse_embedding"]
WORKERS = 2
_jobs = {}


def job(backend):
    if backend not in _jobs:
        _jobs[backend] = launch([sys.executable, HERE / "keras_worker.py"], WORKERS,
                                {"KERAS_BACKEND": backend}, timeout=240)
    return _jobs[backend]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CHECKS)
def test_check_on_two_workers(backend, name):
    assert_check(job(backend), name, WORKERS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_job_exits_cleanly_and_runs_every_check(backend):
    code, out, results = job(backend)
    assert code == 0, out[-4000:]
    assert sorted(results) == sorted(CHECKS), out[-4000:]


CONSISTENCY_CHECKS = ["fit_trains_from_rank_0s_weights", "lr_0_keeps_rank_0s_initial_weights",
                      "unsupported_optimizers_are_refused"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend, mode", [("tensorflow", "ssp:0"), ("tensorflow", "async"),
                                           ("torch", "ssp:1")])
def test_server_held_weights_under_keras(backend, mode):
    code, out, _ = result = launch([sys.executable, HERE / "keras_consistency_worker.py"], WORKERS,
                                   {"KERAS_BACKEND": backend, "BPSTRAIN_CONSISTENCY": mode}, timeout=240)
    for name in CONSISTENCY_CHECKS:
        assert_check(result, name, WORKERS)
    assert code == 0, out[-4000:]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("average_aggregated", [False, True])
def test_reducer_sums_passes_then_communicates_once(standalone_engine, average_aggregated):
    from bpstrain.keras._optimizer import GradientReducer

    reducer = GradientReducer("unit", 3, average_aggregated)
    grads = [[np.full(2, k, np.float32), np.full((1, 2), 10 * k, np.float32)] for k in (1, 2, 3)]
    assert reducer.step(grads[0], [0, 1]) == (False, None)
    assert reducer.step(grads[1], [0, 1]) == (False, None)
    update, out = reducer.step(grads[2], [0, 1])
    scale = 1 / 3 if average_aggregated else 1
    assert update
    np.testing.assert_allclose(out[0], np.full(2, 6 * scale))
    np.testing.assert_allclose(out[1], np.full((1, 2), 60 * scale))
    assert out[0].dtype == np.float32 and grads[0][0][0] == 1  # inputs untouched
    assert reducer.step(grads[0], [0, 1])[0] is False  # a new window starts


@pytest.mark.timeout(30)
def test_reducer_rejects_bad_arguments(standalone_engine):
    from bpstrain.keras._optimizer import GradientReducer

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="backward_passes_per_step"):
            GradientReducer("bad", bad)
    reducer = GradientReducer("shapes", 2)
    reducer.step([np.zeros(2)], [0])
    with pytest.raises(ValueError, match="Received"):
        reducer.step([np.zeros(3)], [0])


@pytest.mark.timeout(300)
def test_model_fit_survives_a_killed_worker_under_fault_tolerance():
    """comm.fault_tolerance with Keras (TensorFlow backend): rank 2 of 3 is SIGKILLed when
    batch 3 begins; the other two finish model.fit with equal kernels, equal to a replay
    averaging 3 workers' gradients before and 2 after."""

    from keras_ft_worker import AT, BATCH, LR, STEPS, rank_data

    code, out, _ = launch([sys.executable, HERE / "keras_ft_worker.py"], 3,
                          {"KERAS_BACKEND": "tensorflow", "BPSTRAIN_FAULT_TOLERANCE": "1"}, timeout=240)
    results = sorted(read_results(out, "FT_RESULT"), key=lambda r: r["rank"])
    assert code == 0 and [r["rank"] for r in results] == [0, 1], out[-4000:]
    assert results[0]["kernel"] == results[1]["kernel"] and all(r["iterations"] == STEPS for r in results)
    w = np.zeros((4, 1))
    data = [rank_data(r) for r in range(3)]
    for step in range(STEPS):
        ranks = range(3) if step < AT else range(2)
        grads = []
        for r in ranks:
            x, y = (a[step * BATCH:(step + 1) * BATCH].astype(np.float64) for a in data[r])
            grads.append(2.0 / BATCH * x.T @ (x @ w - y))
        w -= LR * sum(grads) / len(grads)
    np.testing.assert_allclose(results[0]["kernel"], w.ravel(), rtol=1e-4, atol=1e-5)


def test_a_killed_worker_is_restarted_and_joins_model_fit_with_the_others_state():
    """bpstrain.keras.elastic (Horovod's KerasState and CommitStateCallback): rank 2 of 3
    is SIGKILLed at batch 3 of epoch 0 and the launcher (--max-restarts 1) starts it
    again; it joins at a commit mid-training, gets the weights, the optimizer's momentum
    and step counter and the position, and trains the rest of that epoch and the next.
    All three end with equal kernels, equal to a replay averaging 3 workers' gradients,
    then 2, then 3 again from the step it joined at."""

    from keras_ft_worker import AT, BATCH, LR, STEPS, rank_data
    from keras_join_worker import EPOCHS

    code, out, _ = launch([sys.executable, HERE / "keras_join_worker.py"], 3,
                          {"KERAS_BACKEND": "tensorflow", "BPSTRAIN_FAULT_TOLERANCE": "1", "BPSTRAIN_TIMEOUT": "3"},
                          timeout=240, launcher_args=["--max-restarts", "1"])
    results = sorted(read_results(out, "FT_RESULT"), key=lambda r: r["rank"])
    assert code == 0 and [r["rank"] for r in results] == [0, 1, 2], out[-4000:]
    joiner = results[2]
    assert joiner["restarted"] == "1" and joiner["size"] == 3, joiner
    joined_at = joiner["start"][0] * STEPS + joiner["start"][1]
    assert AT < joined_at < EPOCHS * STEPS, joiner
    for r in results:
        assert r["kernel"] == results[0]["kernel"] and r["iterations"] == EPOCHS * STEPS, r
    w, v = np.zeros((4, 1)), np.zeros((4, 1))
    data = [rank_data(r) for r in range(3)]
    for t in range(EPOCHS * STEPS):
        k = t % STEPS
        ranks = range(3) if t < AT or t >= joined_at else range(2)
        grads = []
        for r in ranks:
            x, y = (a[k * BATCH:(k + 1) * BATCH].astype(np.float64) for a in data[r])
            grads.append(2.0 / BATCH * x.T @ (x @ w - y))
        v = 0.5 * v - LR * sum(grads) / len(grads)
        w = w + v
    np.testing.assert_allclose(results[0]["kernel"], w.ravel(), rtol=1e-4, atol=1e-5)
