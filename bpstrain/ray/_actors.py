"""The Ray actors of a bpstrain job: one per role process.

A role actor (scheduler or server) runs :func:`bpstrain.roles.run_role` in one of its
threads, with the environment it is given (``os.environ`` is left alone); the call
returns when the job ends, so its ObjectRef tells the driver when the role died or
failed. A worker actor sets the DMLC_* environment in its process and calls
:func:`bpstrain.engine.init` there, so framework adapters (``bpstrain.torch`` ...) called
by the user's functions join the same job.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Callable, Dict, List, Mapping, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from bpstrain.errors import BpsError


class RayExecutorError(BpsError):
    """A bpstrain job on Ray failed: an actor or its node died, or a worker raised."""


def node_info() -> dict:
    """Where the calling process runs: Ray node id and IP, and its pid."""
    return {"node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}


def describe(err: BaseException) -> str:
    """Ray's reason in one line, without its traceback banner."""
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = err.cause if getattr(err, "cause", None) is not None else err
        return f"{type(cause).__name__}: {cause}".splitlines()[0] if str(cause) else type(cause).__name__
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:400]}"


def outcome(ref: Any) -> str:
    """How a finished call ended: "it returned" or its error, in one line."""
    try:
        ray.get(ref, timeout=0)
        return "it returned"
    except ray.exceptions.RayError as err:
        return describe(err)


def place(bundles: List[dict], strategy: str, what: str, limit: float, groups: list):
    """A placement group of ``bundles``, ready (appended to ``groups`` first, for cleanup).

    Raises:
        RayExecutorError: not placed within ``limit`` seconds; says what the cluster has.
    """
    group = placement_group(bundles, strategy=strategy)
    groups.append(group)
    if not group.wait(limit):
        raise RayExecutorError(
            f"the placement group of the {what} ({len(bundles)} bundles {bundles[0]}, "
            f"strategy {strategy}) was not placed within {limit:g} s "
            "(placement_group_timeout_s): the cluster has "
            f"{ray.available_resources()} available. Lower the request, add nodes, or "
            "check server_resources names a resource some nodes have")
    return group


def job_env(scheduler_node: dict, port: int, num_workers: int, num_servers: int,
            secret: Optional[str], timeout_s: float, extra: Mapping[str, str]) -> dict:
    """The environment every role of the job shares (one worker per host)."""
    return {**extra, "DMLC_PS_ROOT_URI": scheduler_node["ip"], "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_WORKER": str(num_workers), "DMLC_NUM_SERVER": str(num_servers),
            "BYTEPS_LOCAL_SIZE": "1", "BPSTRAIN_SECRET": secret or secrets.token_hex(32),
            "BPSTRAIN_RENDEZVOUS_TIMEOUT": str(timeout_s)}


def role_env(common: Mapping[str, str], role: str, node: dict, **more: str) -> dict:
    """``common`` plus what one role on ``node`` needs. Nodes of one machine share an IP,
    so the Ray node id tells hosts apart (mixed mode)."""
    return {**common, "DMLC_ROLE": role, "DMLC_NODE_HOST": node["ip"],
            "BPSTRAIN_HOST_ID": f"ray-{node['node_id']}", **more}


def worker_env(common: Mapping[str, str], rank: int, node: dict) -> dict:
    return role_env(common, "worker", node, DMLC_WORKER_ID=str(rank), BYTEPS_LOCAL_RANK="0")


def serve_roles(scheduler, scheduler_node: dict, servers: list, server_nodes: List[dict],
                common: Mapping[str, str]) -> Dict[Any, str]:
    """Starts the scheduler and servers; returns each one's serve() ObjectRef -> its name."""
    roles = {scheduler.serve.remote("scheduler", role_env(common, "scheduler", scheduler_node)):
             "scheduler"}
    for j, (server, node) in enumerate(zip(servers, server_nodes)):
        roles[server.serve.remote("server", role_env(common, "server", node,
                                                     DMLC_SERVER_ID=str(j)))] = f"server {j}"
    return roles


def setup_worker(environ: Mapping[str, str]) -> tuple:
    """In a worker process: takes the job's environment and joins it. Returns (rank, size)."""
    os.environ.update(environ)
    import bpstrain.engine as bps

    bps.init()
    return bps.rank(), bps.size()


def kill_all(actors: list, groups: list) -> None:
    """Kills ``actors`` and removes the placement ``groups``; ones already gone are skipped."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass
    for group in groups:
        try:
            remove_placement_group(group)
        except Exception:
            pass


def teardown_worker() -> None:
    import bpstrain.engine as bps

    bps.shutdown()


class RoleActor:
    """Runs the scheduler or a summation server (CPU only)."""

    def node(self) -> dict:
        return node_info()

    def free_port(self) -> int:
        """A port free on this node's address, for the scheduler to listen on: from below
        the kernel's ephemeral range (``bind(0)`` picked one that Ray's own connections
        took before the scheduler listened on it: "Address already in use")."""
        from bpstrain.launch.local import free_port

        return free_port(ray.util.get_node_ip_address())

    def serve(self, role: str, environ: Mapping[str, str]) -> None:
        from bpstrain.roles import run_role

        run_role(role, dict(environ))


class WorkerActor:
    """One worker process of the job: ``bpstrain.engine.init()`` runs here."""

    def __init__(self):
        self.executable = None

    def node(self) -> dict:
        return node_info()

    def setup(self, environ: Mapping[str, str], executable_cls: Optional[type],
              args: tuple, kwargs: dict) -> tuple:
        ranks = setup_worker(environ)
        if executable_cls is not None:
            self.executable = executable_cls(*args, **kwargs)
        return ranks

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        return fn(*args, **kwargs)

    def execute(self, fn: Callable) -> Any:
        return fn(self.executable)

    def teardown(self) -> None:
        teardown_worker()
