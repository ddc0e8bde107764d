"""The gloo baseline worker runs as real processes on loopback."""

from __future__ import annotations

import sys

import pytest

from bpstrain.bench import _jobs
from bpstrain.bench._hosts import LoopbackHosts
from bpstrain.bench._report import Case
from bpstrain.bench.table import reduce_times


@pytest.mark.timeout(120)
def test_gloo_workers_report_every_iteration():
    payloads = _jobs.run_gloo(LoopbackHosts(), [0, 1], [Case(1 << 16, 3, 1), Case(4096, 5, 1)],
                              timeout_s=90)
    assert [p["rank"] for p in payloads] == [0, 1]
    assert all(p["system"] == "gloo" and p["size"] == 2 for p in payloads)
    assert [len(r["times"]) for r in payloads[0]["results"]] == [3, 5]
    assert set(reduce_times(payloads)) == {1 << 16, 4096}


@pytest.mark.timeout(120)
def test_failing_job_is_reported_and_cleaned_up():
    # Rank 1 rejects its arguments at once; rank 0 would wait for the missing
    # ranks until its own timeout, so the job must end (and kill it) right away.
    hosts = LoopbackHosts()
    job = _jobs.Job(hosts)
    argv = [sys.executable, "-m", "bpstrain.bench._gloo_worker", "--addr", "127.0.0.1",
            "--port", str(hosts.next_port()), "--world-size", "3", "--timeout", "60"]
    job.start("rank0", 0, [*argv, "--rank", "0", "--case", "4096:1"], _jobs.child_env({}),
              worker=True)
    job.start("rank1", 0, [*argv, "--rank", "1", "--case", "bad"], _jobs.child_env({}),
              worker=True)
    with pytest.raises(_jobs.BenchError, match="rank1 failed"):
        job.collect(timeout_s=60)
    assert not any(p.group_alive() for p in job._procs.values())  # groups included
