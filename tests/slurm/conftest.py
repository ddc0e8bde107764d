"""The ``slurm`` fixture: a real 4-node Slurm cluster for this folder's tests (root only)."""

import pytest
from slurm_cluster import SlurmCluster, missing


@pytest.fixture(scope="session")
def slurm():
    """A started :class:`SlurmCluster` of 4 nodes; skips with the reason when impossible."""
    reason = missing()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("bpstrain._core", reason="bpstrain's C++ extension is not built")
    cluster = SlurmCluster(nodes=4).start()
    try:
        yield cluster
    finally:
        cluster.stop()
