"""bpstrain.tensorflow in a real 3-worker job (launcher + scheduler + server + workers).

One launched job (tf_worker.py) holds every check, because each worker pays the
TensorFlow import; the tests here report the checks one by one.
"""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "keras"))
from launched_job import assert_check, launch  # noqa: E402

CHECKS = ["dtypes", "graph_names", "gradients", "variables_and_tape", "optimizers",
          "mismatch", "custom_loop", "xla_refused", "ops_and_compression", "allgather", "sparse_rows"]
WORKERS = 3
_job = []


def job():
    if not _job:
        _job.append(launch([sys.executable, HERE / "tf_worker.py"], WORKERS,
                           {"KERAS_BACKEND": "tensorflow"}, timeout=240))
    return _job[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CHECKS)
def test_check_on_three_workers(name):
    assert_check(job(), name, WORKERS)


@pytest.mark.timeout(300)
def test_job_exits_cleanly_and_runs_every_check():
    code, out, results = job()
    assert code == 0, out[-4000:]
    assert sorted(results) == sorted(CHECKS), out[-4000:]
