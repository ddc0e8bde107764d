"""bpstrain.mxnet in real 2-worker jobs (launcher + scheduler + server + MXNet workers).

MXNet 1.9 needs numpy < 2, so it lives in a venv of its own: the launcher runs with
this interpreter and the workers with the MXNet one, ``$BPSTRAIN_MXNET_PYTHON`` or
``.venv-mxnet/bin/python`` (created by ``bash .ci/install-mxnet``, which CI runs). The
tests skip, saying so, where neither exists. One job (mxnet_worker.py) holds every
check; the tests here report them one by one.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "keras"))
from launched_job import assert_check, launch  # noqa: E402

WORKERS = 2
CHECKS = ["push_pull_and_broadcast_in_place", "broadcast_parameters_dicts_and_gluon",
          "kvstore_sums_over_devices_and_ranks", "equivalence_n_workers_vs_one_process",
          "trainer_allreduce_then_update_and_refusals", "distributed_optimizer_with_module_api",
          "mismatch_raises_on_every_rank_and_job_stays_usable"]


MXNET_PYTHON = (os.environ.get("BPSTRAIN_MXNET_PYTHON")
                or str(REPO / ".venv-mxnet" / "bin" / "python"))
PYTHON = MXNET_PYTHON if os.access(MXNET_PYTHON, os.X_OK) else None
needs_mxnet = pytest.mark.skipif(
    PYTHON is None,
    reason=f"MXNet is absent: no MXNet interpreter at {MXNET_PYTHON} (BPSTRAIN_MXNET_PYTHON, "
           "else .venv-mxnet/bin/python); create it with `bash .ci/install-mxnet` (MXNet 1.9 "
           "needs numpy<2, hence a venv of its own)")
_jobs = {}


def job():
    if "checks" not in _jobs:
        _jobs["checks"] = launch([PYTHON, HERE / "mxnet_worker.py"], WORKERS, {}, timeout=240)
    return _jobs["checks"]


@needs_mxnet
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CHECKS)
def test_check_on_two_workers(name):
    assert_check(job(), name, WORKERS)


@needs_mxnet
@pytest.mark.timeout(300)
def test_job_exits_cleanly_and_runs_every_check():
    code, out, results = job()
    assert code == 0, out[-4000:]
    assert sorted(results) == sorted(CHECKS), out[-4000:]


@needs_mxnet
@pytest.mark.timeout(240)
def test_bytepss_gluon_mnist_example_trains_on_two_workers():
    code, out, _ = launch([PYTHON, "-m", "bpstrain.mxnet.examples.train_gluon_mnist",
                           "--epochs", "1", "--no-cuda", "--j", "0", "--data", "synthetic",
                           "--num-samples", "1024"], WORKERS, {}, timeout=200)
    assert code == 0, out[-4000:]
    assert "[worker 0] INFO:root:Epoch[0]\tTrain: accuracy=" in out, out[-4000:]
    assert "[worker 1] INFO:root:[Epoch 0 Batch 0]" in out, out[-4000:]


@needs_mxnet
@pytest.mark.timeout(60)
def test_adapter_restores_numpy_bool_before_importing_mxnet():
    # Without the shim, `import mxnet` fails on numpy 1.24-1.26 (np.bool).
    probe = ("import numpy, bpstrain.mxnet as bps, mxnet; print(numpy.__version__, "
             "numpy.bool is bool, mxnet.__version__, bps.DistributedTrainer.__mro__[1])")
    proc = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, timeout=50,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    numpy_version, shim, mxnet_version, base = proc.stdout.split(maxsplit=3)
    assert numpy_version < "2" and shim == "True" and mxnet_version.startswith("1.9"), proc.stdout
    assert "gluon.trainer.Trainer" in base, base


@pytest.mark.timeout(60)
def test_ci_installs_the_mxnet_venv_after_the_main_one():
    install = subprocess.run(["bash", str(REPO / ".ci" / "install"), "--dry-run"],
                             capture_output=True, text=True, timeout=30)
    assert install.returncode == 0, install.stderr
    lines = install.stdout.splitlines()
    main = next(i for i, line in enumerate(lines) if 'pip install -q -e ".[' in line or "pip install -q -e .[" in line)
    assert "+ bash .ci/install-mxnet" in lines[main + 1:], lines  # it links .venv's build
    mxnet = subprocess.run(["bash", str(REPO / ".ci" / "install-mxnet"), "--dry-run"],
                           capture_output=True, text=True, timeout=30)
    assert mxnet.returncode == 0, mxnet.stderr
    pip = [line for line in mxnet.stdout.splitlines() if "pip install" in line]
    assert len(pip) == 1 and "numpy==1.26.4" in pip[0] and "mxnet>=1.9.1,<2" in pip[0], pip
    assert "omegaconf>=2.3" in pip[0], pip  # bpstrain's own dependencies, from pyproject
    assert any("/_editable_skbc_bpstrain.pth" in line for line in mxnet.stdout.splitlines())
