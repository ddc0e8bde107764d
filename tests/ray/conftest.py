"""A real multi-node Ray cluster on this machine: a head and 4 nodes (``ray.cluster_utils``).

Nodes 1-2 carry the custom resource ``gpu_node`` (stand-ins for accelerator nodes), nodes
3-4 ``cpu_node`` (CPU-only nodes for servers); every node also ``node_i`` so tests can see
where an actor landed. Small on purpose (2 logical CPUs and 80 MB of object store per
node, no dashboard, no prestarted workers): the machine has 2 cores.
"""

import os
import time

import pytest

_MB = 2**20
NODES = 4


@pytest.fixture(scope="module")
def ray_cluster():
    # Imported here: a skip raised while a conftest loads is an error, not a skip.
    ray = pytest.importorskip("ray", reason='Ray is not installed: pip install -e ".[ray]"')
    from ray.cluster_utils import Cluster

    began = time.monotonic()
    common = {"object_store_memory": 80 * _MB, "num_cpus": 2}
    cluster = Cluster(initialize_head=True, head_node_args={
        **common, "num_cpus": 0, "resources": {"head": 1}, "include_dashboard": False,
        "_system_config": {"enable_worker_prestart": False}})
    nodes = []
    for i in range(1, NODES + 1):
        kind = "gpu_node" if i <= 2 else "cpu_node"
        # One at a time: raylets started side by side time out on a loaded 2-core machine.
        nodes.append(cluster.add_node(**common, resources={f"node_{i}": 1, kind: 1}))
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=True)
    cluster.started_s = time.monotonic() - began
    cluster.node_ids = {n.node_id: f"node_{i}" for i, n in enumerate(nodes, 1)}
    cluster.nodes = {n.node_id: n for n in nodes}
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop("RAY_ADDRESS", None)
