"""bpstrain.torch.ElasticSampler: shares like DistributedSampler, dealt again over the
remaining workers when one leaves (the membership is simulated here; the launched
fault-tolerance jobs are in test_fault_tolerance_jobs.py)."""

import pytest

import bpstrain.torch as bps
from bpstrain import engine


class FakeJob:
    """engine.membership() as a worker of a job that shrinks from 3 to 2 sees it: first
    the scheduler's notice (``epoch``), then the servers' answers (``answered_epoch``)."""

    def __init__(self, monkeypatch, rank):
        self.rank, self.size, self.epoch, self.departed = rank, 3, 0, []
        self.answered_epoch, self.answered_departed = 0, []
        monkeypatch.setattr(engine, "is_initialized", lambda: True)
        monkeypatch.setattr(engine, "membership", lambda: {
            "epoch": self.epoch, "departed": self.departed, "rank": self.rank,
            "size": self.size, "rendezvous_rank": self.rank, "rendezvous_size": 3,
            "answered_epoch": self.answered_epoch, "answered_departed": self.answered_departed})

    def hears_that_worker_2_left(self):
        self.epoch, self.size, self.departed = 1, 2, [2]

    def gets_answers_without_worker_2(self):
        self.answered_epoch, self.answered_departed = 1, [2]

    def worker_2_leaves(self):
        self.hears_that_worker_2_left()
        self.gets_answers_without_worker_2()


def run_epoch(monkeypatch, rank, batch, leave_after, n=50, shuffle=True, hears_after=None):
    """The indices rank `rank` (0 or 1) trains on in one epoch in which worker 2 leaves
    after `leave_after` steps (this rank hears of it from the scheduler after
    `hears_after` steps, the servers' answers show it after `leave_after`); also what the
    departed worker 2 consumed."""
    job = FakeJob(monkeypatch, rank)
    sampler = bps.ElasticSampler(range(n), shuffle=shuffle, seed=3)
    sampler.set_epoch(1)
    departed = bps.ElasticSampler(range(n), shuffle=shuffle, seed=3)
    job.rank = 2
    departed.set_epoch(1)
    job.rank = rank
    gone = [i for _, i in zip(range(leave_after * batch), iter(departed))]
    if leave_after == 0:
        job.worker_2_leaves()  # before the first step
    seen, steps, it = [], 0, iter(sampler)
    while True:
        chunk = [i for _, i in zip(range(batch), it)]
        if not chunk:
            break
        seen += chunk
        steps += 1
        if steps == hears_after:
            job.hears_that_worker_2_left()
        if steps == leave_after:  # the step's answers came without worker 2
            job.worker_2_leaves()
        sampler.record_batch(len(chunk))
    return seen, gone, steps


@pytest.mark.parametrize("leave_after", [0, 2, 4])
def test_the_survivors_cover_every_sample_with_equal_steps_when_a_worker_leaves(monkeypatch, leave_after):
    (a, gone, steps_a), (b, _, steps_b) = (run_epoch(monkeypatch, r, 4, leave_after) for r in (0, 1))
    assert steps_a == steps_b  # lockstep to the end of the epoch
    assert set(a) | set(b) | set(gone) == set(range(50))  # nothing lost, the departed's rest dealt again
    before = 4 * leave_after
    assert len(set(a[before:]) & set(b[before:])) <= 1  # after the deal: disjoint but for padding
    # The departed worker's last batch may not have counted: dealt again (at least once).
    assert set(gone[-4:]) <= set(a[before:]) | set(b[before:])


def test_ranks_that_hear_of_the_departure_at_different_steps_deal_at_the_same_step(monkeypatch):
    # Rank 0 hears from the scheduler a step before the answers show it, rank 1 with
    # them: both deal again after the answers (the step every rank agrees on).
    (a, gone, steps_a), (b, _, steps_b) = (run_epoch(monkeypatch, r, 4, 3, hears_after=2 if r == 0 else 3)
                                           for r in (0, 1))
    assert steps_a == steps_b
    assert set(a) | set(b) | set(gone) == set(range(50))
    assert len(set(a[12:]) & set(b[12:])) <= 1


def test_without_a_membership_change_it_is_a_distributed_sampler(monkeypatch):
    FakeJob(monkeypatch, 1)
    sampler = bps.ElasticSampler(range(10), shuffle=False)
    assert list(sampler) == [1, 4, 7, 0] and len(sampler) == 4  # padded by wrapping, as torch's
    sampler.record_batch(2)
    assert len(sampler) == 2 and list(sampler) == [7, 0]


def test_state_dict_resumes_where_the_epoch_was(monkeypatch):
    FakeJob(monkeypatch, 0)
    sampler = bps.ElasticSampler(range(30), seed=1)
    sampler.set_epoch(2)
    first = list(sampler)[:3]
    sampler.record_batch(3)
    state = sampler.state_dict()
    again = bps.ElasticSampler(range(30), seed=1)
    again.load_state_dict(state)
    assert again.epoch == 2 and not set(first) & set(again)


def test_an_empty_dataset_is_refused():
    with pytest.raises(ValueError, match="non-empty"):
        bps.ElasticSampler([])
