"""The control plane at 64 workers: the small version of ``python -m bpstrain.bench
control-plane``. The job forms, barriers pass and shutdown is clean, once with simulated
nodes (the benchmark's own code, over both transports) and once with 64 real engine
workers in this process. Bounded by pytest-timeout; nothing here asserts a time."""

import os

import pytest

from bpstrain.bench import control_plane
from tests.engine.harness import InProcessCluster


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.timeout(120)
def test_64_simulated_workers_form_a_job_pass_barriers_and_shut_down(transport):
    if transport.startswith("ucx"):
        # Known gap: 68 nodes' links on one process's UCX worker do not form a job in time.
        pytest.skip("64 simulated nodes in one process over UCX do not form a job yet")
    before = _threads()
    case = control_plane.run_case(64, 4, transport=transport, barriers=5, timeout=60)
    assert (case.workers, case.servers) == (64, 4)
    assert case.form_s > 0 and case.barrier_s > 0 and case.shutdown_s > 0
    assert case.threads >= 2 * (64 + 4)  # a reader and an outbox writer per node
    assert _threads() <= before  # the scheduler's threads were all joined


@pytest.mark.timeout(120)
def test_64_engine_workers_and_4_servers_in_one_process_form_pass_barriers_and_finish():
    c = InProcessCluster(workers=64, servers=4, transport="inproc")
    try:
        assert sorted(w.rank for w in c.workers) == list(range(64))
        assert {w.size for w in c.workers} == {64}

        def barriers(rank, w):
            for _ in range(3):
                h = w.enqueue_barrier()
                while not w.wait(h, 0.1):
                    pass
            return rank

        assert c.run_all(barriers) == list(range(64))
    finally:
        c.close()
    assert c.scheduler.wait(0) is True  # every goodbye arrived: the job finished cleanly
