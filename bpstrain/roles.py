"""Runs the scheduler or a summation server in the foreground of this process.

``python -m bpstrain.launch`` calls :func:`run_role` when ``DMLC_ROLE`` is
``scheduler`` or ``server``; the Trainer's local cluster does the same in child
processes. The role returns once every worker has shut down and raises
:class:`bpstrain.errors.BpsError` when the job fails (a node died, rendezvous timed out).
Under the launcher (``BPSTRAIN_SERVE_NEXT_JOB=1``) a role that ended cleanly starts again
on the same port, so workers that call ``init()`` after ``shutdown()`` form a new job;
the launcher stops it when the workers have exited.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from bpstrain.config.env import read_env
from bpstrain.engine import resolve_options
from bpstrain.errors import ConfigError

_WAIT_SLICE = 0.2
SERVE_NEXT_JOB_VAR = "BPSTRAIN_SERVE_NEXT_JOB"
"""Set to 1 by the launcher: a role that ends cleanly starts afresh for the next job."""
# A role waiting for a next job that may never come (its owner stops it) must not time out.
_NEXT_JOB_RENDEZVOUS_S = 1e7


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "") or host.startswith("127.")


def _warn_if_exposed(role: str, env, options) -> None:
    """One clear line when a job reachable from other machines runs without a secret."""
    if role != "scheduler" or options["secret"] or (_is_loopback(env.root_uri) and _is_loopback(env.listen_host or env.root_uri)):
        return
    import sys

    print(f"[bpstrain {role}] warning: this job listens beyond loopback without a cluster secret: "
          "anyone who can reach its ports and joins before your nodes can take a node's place. "
          "Set the same BPSTRAIN_SECRET (e.g. `openssl rand -hex 32`) on every node.",
          file=sys.stderr, flush=True)


def run_role(role: str, environ: Optional[Mapping[str, str]] = None) -> None:
    """Runs ``role`` ("scheduler" or "server") until the job ends.

    Args:
        role: which role to run.
        environ: environment to read (``os.environ`` by default).

    Raises:
        ConfigError: malformed environment.
        BpsError: the job failed; the message says which node and why.
    """
    env = read_env(environ)
    options = resolve_options(None, env)
    if env.root_port is None:
        raise ConfigError(
            "the scheduler's port is not set: export DMLC_PS_ROOT_PORT (e.g. 9000) and "
            "DMLC_PS_ROOT_URI. Received: DMLC_PS_ROOT_PORT unset"
        )
    if role not in ("scheduler", "server"):
        raise ConfigError(f"run_role runs 'scheduler' or 'server'. Received: role={role!r}")
    serve_next = (os.environ if environ is None else environ).get(SERVE_NEXT_JOB_VAR) == "1"
    _warn_if_exposed(role, env, options)
    rendezvous_timeout = float(options["rendezvous_timeout"])
    while True:
        _serve_one_job(role, env, options, rendezvous_timeout)
        if not serve_next:
            return
        rendezvous_timeout = _NEXT_JOB_RENDEZVOUS_S


def _serve_one_job(role: str, env, options, rendezvous_timeout: float) -> None:
    from bpstrain import _core

    if role == "scheduler":
        _core.set_log_prefix("bpstrain scheduler")
        node = _core.Scheduler(
            env.num_worker_hosts,  # hosts; the workers' hellos tell BYTEPS_LOCAL_SIZE
            env.num_servers,
            # Only where the workers were told to connect, not every interface (set
            # BPSTRAIN_LISTEN_HOST=0.0.0.0 when that address is not this host's own,
            # e.g. behind a Kubernetes Service).
            host=env.listen_host or env.root_uri,
            port=env.root_port,
            rendezvous_timeout=rendezvous_timeout,
            peer_timeout=float(options["timeout"]),
            secret=str(options["secret"] or ""),
            local_size=env.local_size if env.local_size_given else 0,
            mixed_mode=env.mixed_mode,
            transport=str(options["transport"]),
            fault_tolerance=bool(options["fault_tolerance"]),
            max_workers=int(options["max_workers"]),
        )
    else:
        _core.set_log_prefix("bpstrain server")
        node = _core.Server(
            env.root_uri,
            env.root_port,
            listen_host=env.listen_host,
            advertise_host=env.node_host,
            server_id=-1 if env.server_id is None else env.server_id,
            engine_threads=int(options["engine_threads"]),
            numa=str(options["numa"]),
            rendezvous_timeout=rendezvous_timeout,
            secret=str(options["secret"] or ""),
            host_id=env.host_id,
            round_timeout=float(options["op_timeout"]),
            authenticate_bodies=bool(options["authenticate_bodies"]),
            transport=str(options["transport"]),
        )
    node.start()
    try:
        while not node.wait(_WAIT_SLICE):
            pass
    finally:
        node.stop()
