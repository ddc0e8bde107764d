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
import socket
from typing import Any, Callable, Mapping, Optional

import ray


def node_info() -> dict:
    """Where the calling process runs: Ray node id and IP, and its pid."""
    return {"node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}


class RoleActor:
    """Runs the scheduler or a summation server (CPU only)."""

    def node(self) -> dict:
        return node_info()

    def free_port(self) -> int:
        """A port free on this node's address, for the scheduler to listen on."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

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
        os.environ.update(environ)
        import bpstrain.engine as bps

        bps.init()
        if executable_cls is not None:
            self.executable = executable_cls(*args, **kwargs)
        return bps.rank(), bps.size()

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        return fn(*args, **kwargs)

    def execute(self, fn: Callable) -> Any:
        return fn(self.executable)

    def teardown(self) -> None:
        import bpstrain.engine as bps

        bps.shutdown()
