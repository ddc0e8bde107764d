"""SIGUSR1 (Slurm's pre-timeout signal) -> checkpoint mid-epoch -> resume at the next batch.

For torch modules and for Keras models (keras_preempt_fit.py: every step logs a hash of
all the model's variables, dropout seeds included).

A launched 2-worker job (the local launcher) is signalled on one rank only; both ranks
stop after the same step, rank 0 saves; a second run resumes. Its step log (epoch, batch,
hash of the batch, loss after dropout) appended to the first run's must equal an
uninterrupted run's, line for line on every rank, and the final weights must be equal.
The Slurm version (a real requeue) is tests/slurm/test_slurm_sbatch.py.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.result_lines import results_by_rank

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "trainer" / "scripts" / "preempt_fit.py"
KERAS_SCRIPT = SCRIPT.with_name("keras_preempt_fit.py")


def _launch(out_dir, log_dir, *extra, env=None, script=SCRIPT):
    return subprocess.Popen(
        [sys.executable, "-m", "bpstrain.launch", "--workers", "2", "--servers", "1", "--",
         sys.executable, str(script), str(out_dir), str(log_dir), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _finish(proc, timeout=120):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def _lines(log_dir, rank):
    path = Path(log_dir) / f"rank{rank}.log"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compression", ["none", "onebit"])
def test_usr1_checkpoints_mid_epoch_and_the_resumed_run_loses_and_repeats_no_step(
        tmp_path, monkeypatch, compression):
    # onebit: worker and server error feedback, which the checkpoint must carry per rank.
    monkeypatch.setenv("BPSTRAIN_COMPRESSION", compression)
    monkeypatch.setenv("BPSTRAIN_COMPRESSION_MIN_SIZE", "0")
    whole = _finish(_launch(tmp_path / "whole", tmp_path / "whole_log"))
    expected = results_by_rank(whole)
    assert sorted(expected) == [0, 1] and expected[0]["steps"] == 3 * 16

    # Interrupted: the steps are slowed so that the signal lands in the first epochs.
    env = {"BPSTRAIN_PREEMPT": "1", "PREEMPT_STEP_SLEEP": "0.1"}
    proc = _launch(tmp_path / "run", tmp_path / "log", env=env)
    deadline = time.monotonic() + 90
    while len(_lines(tmp_path / "log", 1)) < 20:  # into the second epoch (16 per epoch)
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    pid = int((tmp_path / "log" / "rank1.pid").read_text())
    os.kill(pid, signal.SIGUSR1)  # rank 1 only: rank 0 learns it at the next step
    out = _finish(proc)
    stopped = results_by_rank(out, "PREEMPTED")
    assert sorted(stopped) == [0, 1], out
    step = stopped[0]["step"]
    assert stopped[1]["step"] == step and 20 <= step < 48, out
    ckpt = Path(stopped[0]["path"])
    assert ckpt.name == "preempt-local.ckpt" and (ckpt.parent / "last.ckpt").is_file()
    import torch

    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["position"]["batch"] == step % 16 and len(saved["position"]["ranks"]) == 2
    residuals = saved.get("compression_states")
    assert (residuals is not None and len(residuals) == 2) == (compression != "none")
    assert all(len(_lines(tmp_path / "log", r)) == step for r in (0, 1))  # passes = 1

    resumed = _finish(_launch(tmp_path / "run", tmp_path / "log", "auto"))
    assert "resumed from" in resumed and f"batch {step % 16}" in resumed, resumed
    got = results_by_rank(resumed)
    for rank in (0, 1):
        assert _lines(tmp_path / "log", rank) == _lines(tmp_path / "whole_log", rank)
        assert got[rank]["steps"] == 48
        assert got[rank]["weights"] == expected[rank]["weights"]
    # The interrupted epoch's metrics (sums kept across the restart) match too.
    assert got[0]["history"] == expected[0]["history"]
    # One run folder: the resume continued in it (metrics.csv has every epoch once).
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["version_0"]
    rows = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 3


class _SignalSelf:
    """Sends this process SIGUSR1 at one batch (as Slurm would, 90 s before the limit)."""

    def __init__(self, at: int):
        self.at, self.sent = at, False

    def __call__(self, trainer, batch_idx):
        if not self.sent and trainer.progress_step == self.at:
            self.sent = True
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.mark.timeout(120)
def test_one_worker_in_process_stops_at_the_signal_and_resumes_exactly(tmp_path, monkeypatch):
    import torch

    from bpstrain.trainer import Callback, Preempted, Trainer
    from tests.trainer.helpers import base_config, blobs

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from preempt_fit import EpochTag, LoggedNet

    class Signal(Callback):
        def __init__(self, at):
            self.send = _SignalSelf(at)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.send(trainer, batch_idx)

    x, y = blobs(128)
    cfg = {"trainer.epochs": 2, "trainer.batch_size": 16, "cluster.workers": 1,
           "optimizer.backward_passes_per_step": 2}

    def fit(out, log, *callbacks, **extra):
        model = LoggedNet(tmp_path / log)
        Trainer(base_config(tmp_path / out, **cfg, **extra),
                callbacks=[EpochTag(), *callbacks]).fit(model, (x, y))
        return model

    whole = fit("whole", "whole.log")
    monkeypatch.setenv("BPSTRAIN_PREEMPT", "1")
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(Preempted) as stopped:
        fit("run", "run.log", Signal(at=11))  # mid-accumulation: stops after batch 12
    assert signal.getsignal(signal.SIGUSR1) == before  # the handler is put back
    assert stopped.value.code == 0 and stopped.value.global_step == 6
    assert len((tmp_path / "run.log").read_text().splitlines()) == 12
    resumed = fit("run", "run.log", **{"trainer.resume": "auto"})
    assert (tmp_path / "run.log").read_text() == (tmp_path / "whole.log").read_text()
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def _signal_rank1_after(proc, log_dir, lines):
    """Sends SIGUSR1 to rank 1 once it has logged ``lines`` steps (as Slurm would)."""
    deadline = time.monotonic() + 120
    while len(_lines(log_dir, 1)) < lines:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    os.kill(int((Path(log_dir) / "rank1.pid").read_text()), signal.SIGUSR1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compression", ["none", "onebit"])
def test_keras_model_checkpoints_mid_epoch_and_resumes_with_every_step_equal(
        tmp_path, monkeypatch, compression):
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    monkeypatch.setenv("BPSTRAIN_COMPRESSION", compression)
    monkeypatch.setenv("BPSTRAIN_COMPRESSION_MIN_SIZE", "0")
    whole = _finish(_launch(tmp_path / "whole", tmp_path / "whole_log", script=KERAS_SCRIPT))
    expected = results_by_rank(whole)
    assert sorted(expected) == [0, 1] and expected[0]["steps"] == 3 * 16, whole

    env = {"BPSTRAIN_PREEMPT": "1", "PREEMPT_STEP_SLEEP": "0.1"}
    proc = _launch(tmp_path / "run", tmp_path / "log", env=env, script=KERAS_SCRIPT)
    _signal_rank1_after(proc, tmp_path / "log", 20)  # into the second epoch
    out = _finish(proc)
    stopped = results_by_rank(out, "PREEMPTED")
    assert sorted(stopped) == [0, 1], out
    step = stopped[0]["step"]
    assert stopped[1]["step"] == step and 20 <= step < 48, out
    import torch

    saved = torch.load(stopped[0]["path"], map_location="cpu", weights_only=False)
    assert saved["position"]["batch"] == step % 16 and len(saved["position"]["ranks"]) == 2
    assert len(saved["keras_optimizer"]["optimizer"]) == 6  # iterations, lr, 4 momenta
    assert (saved.get("compression_states") is not None) == (compression != "none")
    assert all(len(_lines(tmp_path / "log", r)) == step for r in (0, 1))

    resumed = _finish(_launch(tmp_path / "run", tmp_path / "log", "auto", script=KERAS_SCRIPT))
    assert "resumed from" in resumed and f"batch {step % 16}" in resumed, resumed
    got = results_by_rank(resumed)
    for rank in (0, 1):
        # Every step's weights and seeds, before and after the restart, bit for bit.
        assert _lines(tmp_path / "log", rank) == _lines(tmp_path / "whole_log", rank)
        assert got[rank]["steps"] == 48 and got[rank]["iterations"] == 48
        assert got[rank]["weights"] == expected[rank]["weights"]
    # The interrupted epoch's metrics: its two parts' sums give the uninterrupted means.
    for a, b in zip(got[0]["history"], expected[0]["history"]):
        assert a.keys() == b.keys() and a == pytest.approx(b, rel=1e-5), (a, b)
    rows = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 3
