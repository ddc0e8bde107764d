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
    session = cluster.head_node.session_name
    try:
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
        yield cluster
    finally:
        psutil = pytest.importorskip("psutil")
        before = _ray_processes(psutil, session)
        try:
            ray.shutdown()
            cluster.shutdown()
        finally:
            os.environ.pop("RAY_ADDRESS", None)
            _end_leftovers(psutil, before + _ray_processes(psutil, session))


def _ray_processes(psutil, session: str) -> list:
    """This cluster's processes: the session's daemons (the session name is on their
    command line) and, under this process, the ``ray::...`` workers and agents."""
    found = []
    try:
        below = {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        below = set()
    for proc in psutil.process_iter(["cmdline"]):
        try:
            line = " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if proc.pid != os.getpid() and (session in line or (
                proc.pid in below and line.startswith("ray::"))):
            found.append(proc)
    return found


def _end_leftovers(psutil, procs: list, wait_s: float = 15.0) -> None:
    """Ends (by pid) what ``cluster.shutdown()`` left: a raylet, GCS, agent or worker
    outliving the tests would fail the checks that run after them."""
    import signal

    def alive(proc) -> bool:  # is_running() also tells a reused pid from ours
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + wait_s
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    for proc in procs:
        if alive(proc):
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(5)  # reaps our own children
        except (psutil.Error, ChildProcessError):
            pass
