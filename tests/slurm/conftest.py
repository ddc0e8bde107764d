"""The ``slurm`` fixture: a real 4-node Slurm cluster for this folder's tests (root only)."""

import pytest
from slurm_cluster import SlurmCluster, missing


@pytest.fixture(scope="module")
def slurm():
    """A started :class:`SlurmCluster` of 4 nodes; skips with the reason when impossible.

    Per module, not per session: its daemons (munged, slurmctld, slurmd) are children of
    pytest, and later folders' tests check that their jobs leave no child process behind.
    """
    reason = missing()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("bpstrain._core", reason="bpstrain's C++ extension is not built")
    cluster = SlurmCluster(nodes=4).start()
    try:
        yield cluster
    finally:
        cluster.stop()
