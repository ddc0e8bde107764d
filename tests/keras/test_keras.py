"""bpstrain.keras: real 2-worker jobs on both Keras backends, plus in-process unit tests.

Each backend runs one launched job (keras_worker.py) holding every check, because each
worker pays the backend import; the tests here report the checks one by one.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

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
