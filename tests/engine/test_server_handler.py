"""The server handler seam: per-key logic plugs in without touching the server's I/O.
Here a handler written in Python answers each round with the element-wise maximum."""

import numpy as np
import pytest

from bpstrain.errors import BpsError
from tests.engine.harness import InProcessCluster, push_pull

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("transport")]


class MaxHandler:
    def __init__(self):
        self.rounds = {}

    def on_push(self, key, version, dtype, sender, data):
        x = np.frombuffer(data, dtype=dtype).copy()
        prev = self.rounds.get((key, version))
        self.rounds[(key, version)] = x if prev is None else np.maximum(prev, x)

    def on_round_complete(self, key, version, dtype, nbytes, senders):
        assert sorted(senders) == list(range(len(senders)))
        return self.rounds.pop((key, version)).tobytes()


def test_a_custom_handler_replaces_the_sum():
    with InProcessCluster(3, 2, partition_bytes=64, handler=MaxHandler) as c:
        def job(rank, w):
            x = np.arange(50, dtype=np.float32) * (rank + 1) * (-1) ** rank
            return push_pull(w, "m", x)  # several partitions on two servers, two rounds
        for _ in range(2):
            res = c.run_all(job)
            expect = np.max([np.arange(50, dtype=np.float32) * (r + 1) * (-1) ** r for r in range(3)], axis=0)
            for x in res:
                np.testing.assert_array_equal(x, expect)


class WrongSizeHandler(MaxHandler):
    def on_round_complete(self, key, version, dtype, nbytes, senders):
        return b"\0"


def test_a_handler_error_reaches_every_worker_and_the_job_goes_on():
    with InProcessCluster(2, 1, handler=WrongSizeHandler) as c:
        def job(rank, w):
            with pytest.raises(BpsError, match="server handler answered 1 bytes"):
                push_pull(w, "m", np.ones(4, np.float32))
            return True
        assert all(c.run_all(job))
