"""fit with a 2-worker local cluster from a plain parent process (what a notebook does).

Workers are ``spawn``-ed children; afterwards none may be left, and the scheduler's
port must be free. Python's own multiprocessing resource tracker (one helper per
interpreter, started by any spawn) is not a worker and is not counted.
"""

import json
import multiprocessing
import os
import queue
import socket
import time
from pathlib import Path

import psutil
import pytest
import torch

from bpstrain.launch import free_port
from bpstrain.trainer import RemoteTraceback, Trainer
from bpstrain.trainer._local_cluster import _Inbox
from bpstrain.trainer.callbacks import find_last_checkpoint, read_checkpoint
from bpstrain.errors import PeerError
from tests.trainer import helpers
from tests.trainer.helpers import (DieWritingCheckpoint, ExitAndRejoin, ExitWorker, SeenSamples, FailingModule, InterruptParent, Recorder,
                                   base_config, blobs, tiny_net)


def _children():
    kids = psutil.Process().children(recursive=True)
    return [p for p in kids if "resource_tracker" not in " ".join(_cmdline(p))]


def _cmdline(proc):
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _port_is_free(port):
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _cluster_config(tmp_path, **extra):
    return base_config(tmp_path, **{"cluster.workers": 2, "cluster.port": free_port(), **extra})


@pytest.mark.timeout(120)
def test_a_worker_dying_mid_message_delivers_what_it_sent_and_frees_its_reader():
    # The parent holds no write end of a worker's pipe once the worker has started, so a
    # message cut short by the worker's death is an end of file, not a read for ever.
    ctx = multiprocessing.get_context("spawn")
    inbox = _Inbox(ctx)
    try:
        cut, whole = inbox.new_queue(), inbox.new_queue()
        procs = [ctx.Process(target=helpers.send_then_die_mid_message, args=(cut,)),
                 ctx.Process(target=helpers.send_messages, args=(whole, 3))]
        for proc, outbox in zip(procs, (cut, whole)):
            proc.start()
            inbox.started(outbox)
        got = sorted(inbox.get(timeout=60)[3] for _ in range(4))
        assert got == ["line 0", "line 1", "line 2", "whole"]
        for proc in procs:
            proc.join(60)
        assert [proc.exitcode for proc in procs] == [3, 0]
        deadline = time.monotonic() + 10
        while any(t.is_alive() for t in inbox._threads) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(t.is_alive() for t in inbox._threads), "a reader still waits on a dead worker"
        with pytest.raises(queue.Empty):
            inbox.get(timeout=0.1)  # the cut message is not delivered half-read
    finally:
        inbox.close()


def test_two_worker_fit_returns_history_weights_and_timeline(tmp_path, capsys):
    x, y = blobs(256)
    model = tiny_net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recorder = Recorder()
    trainer = Trainer(_cluster_config(tmp_path, **{"trainer.epochs": 3, "trainer.timeline": True,
                                                   "trainer.progress": True,
                                                   "trainer.checkpoint_every": 1}),
                      callbacks=[recorder])
    history = trainer.fit(model, (x, y), val_data=(x, y))
    out, err = capsys.readouterr()
    # Rank 0's bars only: one per epoch (4 steps each) and one per validation pass.
    for epoch in (1, 2, 3):
        assert err.count(f"epoch {epoch}/3:   0%|") == 1 and f"epoch {epoch}/3: 100%" in err
    assert err.count("validation:   0%|") == 3
    assert out.count("epoch 3/3: loss=") == 1  # metrics streamed once per epoch, by rank 0

    assert len(history) == 3 and history.last["val_accuracy"] > 0.9
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():  # the weights that came back are the trained ones
        accuracy = (model(torch.from_numpy(x)).argmax(1).numpy() == y).mean()
    assert accuracy == pytest.approx(history.last["val_accuracy"], abs=1e-6)
    assert recorder.epochs_seen == 3  # rank 0's callback state came back too
    assert _children() == []

    assert trainer.run_dir == tmp_path / "version_0"  # named by the notebook side
    assert (trainer.run_dir / "config.yaml").is_file()
    trace = json.loads((trainer.run_dir / "timeline.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "push_pull"]
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank]
        names = {e["args"]["tensor"] for e in mine}
        # DistributedOptimizer fuses small gradients into buckets (all four fit one).
        grads = [n for n in names if ".grad." in n or ".bucket" in n or n.startswith("bucket")]
        assert grads, names
        assert all(e["dur"] >= 0 and e["ts"] > 0 for e in mine)
        grad_events = [e for e in mine if e["args"]["tensor"] in grads]
        assert len(grad_events) >= 3 * 4  # at least one gradient op per step, 4 steps x 3 epochs
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"} == {
        "worker 0", "worker 1"}
    # The engine's own phases: a push and a pull span per tensor and round, push first.
    for phase in ("push", "pull"):
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == phase]
        assert len(spans) >= 2 * 3 * 4, phase
    pushes = {(e["pid"], e["args"]["tensor"], e["args"]["round"]): e for e in trace["traceEvents"]
              if e.get("cat") == "push"}
    for e in trace["traceEvents"]:
        if e.get("cat") == "pull":
            push = pushes[(e["pid"], e["args"]["tensor"], e["args"]["round"])]
            assert push["ts"] <= e["ts"] + e["dur"]

    # Re-running in the same process works (a new cluster, new port), here resuming the
    # checkpoint of the first run for one more epoch.
    again = Trainer(_cluster_config(tmp_path, **{"trainer.epochs": 4, "trainer.resume": "auto"}))
    history = again.fit(tiny_net(), (x, y), val_data=(x, y))
    assert [e["epoch"] for e in history.epochs] == [0, 1, 2, 3] and _children() == []
    assert again.run_dir == trainer.run_dir  # resume=auto continued the same run folder


@pytest.mark.timeout(120)
def test_worker_exception_is_reraised_with_its_traceback(tmp_path, capsys):
    x, y = blobs(256)
    cfg = _cluster_config(tmp_path)
    with pytest.raises(ValueError, match="boom on rank 1 at batch 2") as info:
        Trainer(cfg).fit(FailingModule(fail_rank=1, fail_batch=2), (x, y))
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "Traceback of worker 1" in str(cause) and "in training_step" in str(cause)
    assert info.value.rank == 1
    out, err = capsys.readouterr()
    assert "[worker 1] about to fail on rank 1" in out  # prints forwarded
    # Stopping worker 0 is our doing: no "[scheduler] worker 0 closed its connection".
    assert "closed its connection" not in out + err and "failed:" not in out + err
    assert _children() == []
    assert _port_is_free(cfg["cluster.port"])


@pytest.mark.timeout(120)
def test_worker_that_dies_silently_is_reported(tmp_path):
    x, y = blobs(256)
    with pytest.raises(PeerError, match="worker 1"):
        Trainer(_cluster_config(tmp_path), callbacks=[ExitWorker(rank=1)]).fit(tiny_net(), (x, y))
    assert _children() == []


@pytest.mark.timeout(120)
def test_keyboard_interrupt_stops_every_child_and_frees_the_port(tmp_path, capsys):
    x, y = blobs(2048)
    cfg = _cluster_config(tmp_path, **{"trainer.epochs": 50})
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, callbacks=[InterruptParent(at_batch=2)]).fit(tiny_net(), (x, y))
    out, err = capsys.readouterr()
    assert "interrupted: stopping the local cluster's processes" in err
    assert "closed its connection" not in out + err and "failed:" not in out + err
    assert _children() == []
    assert _port_is_free(cfg["cluster.port"])
    # The "kernel" is still usable: the same call runs again.
    history = Trainer({**cfg, "trainer.epochs": 1}).fit(tiny_net(), (x[:256], y[:256]))
    assert len(history) == 1 and _children() == []


@pytest.mark.timeout(60)
def test_unpicklable_data_fails_early_with_a_hint(tmp_path):
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match="must be picklable"):
        Trainer(_cluster_config(tmp_path)).fit(tiny_net(), lambda: lock)
    assert _children() == []


@pytest.mark.timeout(90)
def test_script_without_main_guard_fails_fast_with_a_hint(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from bpstrain.trainer import Trainer\n"
        "from tests.trainer.helpers import base_config, blobs, tiny_net\n"
        f"Trainer(base_config({str(tmp_path)!r}, **{{'cluster.workers': 2}})).fit(\n"
        "    tiny_net(), blobs(64))\n")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=80, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in proc.stderr
    assert "PeerError" in proc.stderr or "RuntimeError" in proc.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", [2, 0])
def test_with_fault_tolerance_the_others_finish_when_a_worker_dies(tmp_path, capsys, victim):
    """comm.fault_tolerance in the Trainer's own local cluster: one worker of 3 exits at its
    first batch; the other two train every epoch and fit returns the model (from the first
    worker still in the job when rank 0 is the one that died), and the epochs' lines are
    printed by whichever worker is rank 0."""
    x, y = blobs(512)
    model = tiny_net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = base_config(tmp_path, **{"cluster.workers": 3, "cluster.port": free_port(), "trainer.epochs": 2,
                                   "comm.fault_tolerance": True, "comm.timeout": 5, "trainer.progress": True})
    seen = tmp_path / "seen"
    seen.mkdir()
    history = Trainer(cfg, callbacks=[ExitWorker(rank=victim), SeenSamples(seen)]).fit(model, (x, y), val_data=(x, y))
    assert len(history["loss"]) == 2 and history["loss"][-1] < history["loss"][0]
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    out = capsys.readouterr()
    assert f"worker {victim} exited with code 3; fault tolerance: the job goes on with 2 workers" in out.err
    # The progress bar and the epoch lines go on when rank 0 left: the new rank 0 draws them.
    assert "epoch 1/2: loss=" in out.out + out.err and "epoch 2/2: loss=" in out.out + out.err, out
    # The data followed the membership: the two survivors trained every sample of each
    # epoch (the departed worker's share was dealt to them), in equal steps.
    index = {(f"{a:.5f}", f"{b:.5f}"): i for i, (a, b) in enumerate(x[:, :2])}
    files = sorted(seen.iterdir())
    assert len(files) == 2, files
    for epoch in (0, 1):
        per_worker = [[index[tuple(line.split()[1:])] for line in f.read_text().splitlines()
                       if line.split()[0] == str(epoch)] for f in files]
        assert set(per_worker[0]) | set(per_worker[1]) == set(range(len(x))), epoch
        assert len(per_worker[0]) == len(per_worker[1]), epoch
    assert _children() == []


@pytest.mark.timeout(180)
def test_with_max_restarts_a_worker_that_died_is_started_again_and_rejoins(tmp_path, capsys):
    """cluster.max_restarts: worker 2 of 3 dies at step 2; the local cluster starts it
    again, it joins the running job with the others' state and position, and all three
    finish every epoch; fit returns the model, and every sample of each epoch trained."""
    x, y = blobs(384)
    model = tiny_net()
    cfg = base_config(tmp_path, **{"cluster.workers": 3, "cluster.port": free_port(), "trainer.epochs": 3,
                                   "comm.fault_tolerance": True, "comm.timeout": 5, "cluster.max_restarts": 1})
    seen = tmp_path / "seen"
    seen.mkdir()
    history = Trainer(cfg, callbacks=[ExitAndRejoin(tmp_path / "restarted"), SeenSamples(seen)]).fit(model, (x, y))
    assert len(history["loss"]) == 3 and history["loss"][-1] < history["loss"][0]
    out = capsys.readouterr()
    assert "worker 2 exited with code 3; fault tolerance: restarted it (1 of 1)" in out.err, out.err
    assert "worker(s) [2] joined the job at epoch" in out.out + out.err, out
    index = {(f"{a:.5f}", f"{b:.5f}"): i for i, (a, b) in enumerate(x[:, :2])}
    files = sorted(seen.iterdir())
    assert len(files) == 4, files  # the three processes of the start and the restarted one
    epochs = [{line.split()[0] for line in f.read_text().splitlines()} for f in files]
    assert sum("2" in e for e in epochs) == 3, epochs  # three workers trained the last epoch
    for epoch in (0, 1, 2):
        trained = {index[tuple(line.split()[1:])] for f in files for line in f.read_text().splitlines()
                   if line.split()[0] == str(epoch)}
        assert trained == set(range(len(x))), epoch
    assert _children() == []


@pytest.mark.timeout(180)
def test_with_fault_tolerance_rank_0_dying_in_a_checkpoint_write_loses_no_checkpoint(tmp_path, capsys):
    """Rank 0 of 3 dies halfway through writing epoch 0's checkpoint: no half checkpoint is
    ever visible, the next rank 0 writes the later epochs' checkpoints, and a new job
    resumes from the last one."""
    x, y = blobs(256)
    cfg = base_config(tmp_path, **{"cluster.workers": 3, "cluster.port": free_port(), "trainer.epochs": 3,
                                   "trainer.checkpoint_every": 1, "comm.fault_tolerance": True,
                                   "comm.timeout": 5})
    history = Trainer(cfg, callbacks=[DieWritingCheckpoint()]).fit(tiny_net(), (x, y))
    assert len(history["loss"]) == 3
    assert "worker 0 exited with code 3; fault tolerance: the job goes on with 2 workers" in capsys.readouterr().err
    folder = find_last_checkpoint(tmp_path).parent
    names = sorted(p.name for p in folder.iterdir() if p.name.startswith("epoch=") and p.suffix == ".ckpt")
    assert names == ["epoch=0001.ckpt", "epoch=0002.ckpt"], names  # epoch 0's never landed
    assert read_checkpoint(folder / "epoch=0002.ckpt")["epoch"] == 2
    again = Trainer(base_config(tmp_path, **{"cluster.workers": 2, "cluster.port": free_port(),
                                             "trainer.epochs": 4, "trainer.resume": "auto"}))
    resumed = again.fit(tiny_net(), (x, y))
    assert [e["epoch"] for e in resumed.epochs] == [0, 1, 2, 3]
    assert _children() == []
