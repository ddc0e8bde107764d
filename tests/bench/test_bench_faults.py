"""The faults benchmark's accounting (bpstrain.bench.faults), on made-up progress lines:
what a stall, a lost step, a goodput are. The benchmark itself needs root and minutes
(a README command)."""

import pytest

from bpstrain.bench import faults
from bpstrain.bench.faults import MODELS, Injected, _summarize, format_tables

BATCH = MODELS["digits_cnn"]


def _steps(system, rank, points):
    return [(t, s, w, f"{system}-{rank}-1") for t, s, w in points]


def test_a_survivor_that_waited_for_detection_stalls_and_loses_nothing():
    # 4 workers, a step every 0.1 s; worker 2 hangs at t=1.0 after step 10; the others
    # finish step 11 at t=4.0 (detection), then go on with 3; 2's replacement is back at 6.0.
    points = [(0.1 * s, s, 4) for s in range(1, 11)] + [(4.0, 11, 3)] + \
             [(4.0 + 0.1 * k, 11 + k, 3) for k in range(1, 20)] + [(6.05, 31, 4)]
    steps = _steps("bpstrain", 0, points) + _steps("bpstrain", 2, [(6.05, 31, 4)])
    notes = [(3.99, "membership size=3 departed=[2]", "bpstrain-0-1"),
             (6.0, "start step=30 restart=1", "bpstrain-2-2")]
    steps[-1] = (6.05, 31, 4, "bpstrain-2-2")
    s = _summarize("bpstrain", sorted(steps), notes, [Injected("stop", 2, 1.0)], 0.97)
    (e,) = s["events"]
    assert e["steps_lost"] == 0 and e["stall_s"] == pytest.approx(3.0)
    assert e["noticed_s"] == pytest.approx(2.99) and e["back_s"] == pytest.approx(5.05)
    # Samples that count: the workers of each step.
    assert s["samples"] == (10 * 4 + 20 * 3 + 4) * BATCH and s["accuracy"] == 0.97


def test_a_restart_from_a_checkpoint_loses_the_steps_since_it():
    # torchrun: step 57 done at 5.7 s, a worker killed at 6.0, everyone restarts from the
    # checkpoint of step 50 and completes step 51 at 20.1.
    before = [(0.1 * s, s, 4) for s in range(1, 58)]
    after = [(20.0 + 0.1 * k, 50 + k, 4) for k in range(1, 60)]
    steps = [p for r in range(4) for p in _steps("torchrun", r, before + after)]
    notes = [(12.0, "launched", "torchrun-1-2"), (19.0, "start step=50 restart=1", "torchrun-1-2")]
    s = _summarize("torchrun", sorted(steps), notes, [Injected("kill", 1, 6.0)], 0.98)
    (e,) = s["events"]
    assert e["steps_lost"] == 7 and e["stall_s"] == pytest.approx(14.1) and e["noticed_s"] == pytest.approx(6.0)
    assert s["samples"] == 109 * 4 * BATCH  # every step once, on 4 workers
    clean = {**s, "faults": False, "samples_per_s": 2 * s["samples_per_s"], "events": []}
    table = format_tables([clean, {**s, "faults": True}])
    assert "| torchrun | kill host 1 | 5.9 | 6.00 | 14.10 | 7 |" in table and "| 0.50 |" in table


def test_a_torchft_step_that_did_not_commit_is_a_step_lost():
    # torchft: groups 0 and 1 (group 1 killed at 1.05); group 0's step 11 fails its
    # allreduce (not committed), then commits alone from 2.0.
    points = [(0.1 * s, s, 2) for s in range(1, 11)] + [(2.0 + 0.1 * k, 10 + k, 1) for k in range(1, 10)]
    notes = [(1.9, "uncommitted step=10", "torchft-0-1"), (1.95, "membership size=1", "torchft-0-1")]
    s = _summarize("torchft", _steps("torchft", 0, points), notes, [Injected("kill", 1, 1.05)], 0.9)
    (e,) = s["events"]
    assert e["steps_lost"] == 1 and e["noticed_s"] == pytest.approx(0.9) and e["back_s"] is None
    assert s["samples"] == (10 * 2 + 9 * 1) * BATCH


def test_a_server_event_is_noticed_when_a_step_went_over_the_moved_partitions():
    points = [(0.1 * s, s, 4) for s in range(1, 30)]
    notes = [(1.52, "servers lost=[1]", "bpstrain-0-1")]
    s = _summarize("bpstrain", _steps("bpstrain", 0, points), notes, [Injected("server", 5, 1.45)], 0.9)
    (e,) = s["events"]
    assert e["event"] == "server" and e["noticed_s"] == pytest.approx(0.07) and e["back_s"] is None
    # One that came after the last step is left out.
    late = _summarize("bpstrain", _steps("bpstrain", 0, points), notes, [Injected("server", 5, 1.45),
                                                                          Injected("kill", 1, 9.0)], 0.9)
    assert [e["event"] for e in late["events"]] == ["server"]


def test_a_run_that_failed_is_a_row_that_says_why_and_the_others_stay():
    exc = faults._jobs.BenchError("worker2 failed (exit code 1):\nTraceback ...\n  raise X\n"
                                  "torch.distributed.elastic.rendezvous.api.RendezvousClosedError\n")
    reason = faults._failure(exc)
    assert reason == "worker2 failed (exit code 1): torch.distributed.elastic.rendezvous.api.RendezvousClosedError"
    ok = {"system": "bpstrain", "events": [], "samples_per_s": 100.0, "accuracy": 0.9}
    table = format_tables([{**ok, "faults": False}, {**ok, "faults": True, "samples_per_s": 95.0},
                           {**ok, "system": "torchrun", "faults": False},
                           {"system": "torchrun", "events": [], "failed": reason, "faults": True}])
    assert "| bpstrain | 100 | 95.00 | 0.95 |" in table, table
    assert f"| torchrun | – | failed: {reason} | – | – | – |" in table, table


def test_unknown_events_or_every_server_killed_are_refused():
    with pytest.raises(ValueError, match="events are kill, stop, cut, server"):
        faults.run(faults.Plan(events=["reboot"]))
    with pytest.raises(ValueError, match="one must stay"):
        faults.run(faults.Plan(servers=2, events=["server", "server"], systems=["bpstrain"]))


def test_a_timed_run_counts_the_steps_of_its_duration_and_finds_its_first_step(tmp_path):
    # --duration 1.95: steps every 0.1 s from t=100.3 (the first step) until the run was
    # stopped at 103.0; what completed after 102.25 ran as it was being stopped.
    points = [(100.2 + 0.1 * s, s, 4) for s in range(1, 28)]
    notes = [(100.0, "start step=0 restart=0", "bpstrain-0-1"), (102.6, "membership size=3", "bpstrain-0-1")]
    steps, kept = faults._within(_steps("bpstrain", 0, points), notes, 1.95)
    assert [s for _, s, _, _ in steps] == list(range(1, 21)) and kept == notes[:1]
    s = _summarize("bpstrain", steps, kept, [Injected("kill", 1, 101.0), Injected("stop", 2, 102.22),
                                          Injected("cut", 3, 102.5)], float("nan"), duration=1.95)
    # The window ends at 102.25: the stop after its last step counts (a pause until its end),
    # the cut after it does not; samples per second are the window's (2,560 in 1.95 s).
    assert s["samples"] == 20 * 4 * BATCH and [e["event"] for e in s["events"]] == ["kill", "stop"]
    assert s["events"][1]["stall_s"] == pytest.approx(0.03)
    assert s["seconds"] == pytest.approx(1.95) and s["samples_per_s"] == pytest.approx(2560 / 1.95)
    table = format_tables([{**s, "faults": False, "events": []}, {**s, "faults": True}])
    assert "| bpstrain | 1313 | 1313 | 1.00 | – | – |" in table, table
    # A restart still under way when the window ends (torchrun's, after a kill at 6.05): its
    # pause until the end is the stall, and the samples per second count the idle time.
    points = [(0.1 * s, s, 4) for s in range(1, 61)]
    steps = [p for r in range(4) for p in _steps("torchrun", r, points)]
    s = _summarize("torchrun", sorted(steps), [], [Injected("kill", 1, 6.05)], float("nan"), duration=59.9)
    (e,) = s["events"]
    assert e["stall_s"] == pytest.approx(59.9 + 0.1 - 6.05) and e["back_s"] is None and e["noticed_s"] is None
    assert s["samples_per_s"] == pytest.approx(60 * 4 * BATCH / 59.9)
    # The supervisor's clock starts at the first step a progress file records.
    (tmp_path / "bpstrain-0-1").write_text("# 100.0 start step=0 restart=0\n1 100.3 4\n2 100.4 4\n")
    (tmp_path / "bpstrain-1-1").write_text("# 100.1 start step=0 restart=0\n")
    assert faults._first_step_at(str(tmp_path)) == 100.3
    assert faults._first_step_at(str(tmp_path / "none")) == 0.0
