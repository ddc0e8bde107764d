"""Command line of ``python -m bpstrain.launch``.

Four ways to call it:

* ``python -m bpstrain.launch --workers N --servers K [--local-size L] [--mixed] -- CMD ...``
  starts a whole job on this host (see :func:`bpstrain.launch.launch_local`). N counts
  processes; the children see BytePS's variables (``DMLC_NUM_WORKER`` = N/L hosts,
  ``BYTEPS_LOCAL_SIZE`` = L).
* ``DMLC_ROLE=scheduler|server python -m bpstrain.launch [ignored ...]`` runs that
  role in the foreground, as in a BytePS job started by hand.
* ``DMLC_ROLE=worker python -m bpstrain.launch CMD ...`` runs CMD as a worker
  with the environment passed through, like BytePS's ``bpslaunch``; with
  ``BYTEPS_LOCAL_SIZE=L`` and no ``BYTEPS_LOCAL_RANK`` it starts L local copies.

* ``python -m bpstrain.launch --join FILE [-- CMD ...]`` adds a worker to a running job
  started with fault tolerance (the launcher prints FILE; see :mod:`bpstrain.launch._join`).
* ``python -m bpstrain.launch k8s --workers N --image IMAGE ... -- CMD ...`` prints
  Kubernetes manifests for the job (see :mod:`bpstrain.launch.k8s`).
* ``srun ... python -m bpstrain.launch --slurm [--local-size L] -- CMD ...`` runs in
  every task of a Slurm step and forms one job of them (see :mod:`bpstrain.launch.slurm`).

Exit status 2 means bad arguments or environment.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from typing import Mapping, Sequence

from bpstrain.launch import _procs
from bpstrain.launch.local import launch_local

PROG = "python -m bpstrain.launch"
USAGE_EXIT = 2
_ROLES = ("scheduler", "server", "worker")


class UsageError(Exception):
    """Bad arguments or environment; the message is shown and the exit status is 2."""


def _int_flag(flag: str, minimum: int, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            bound = f"an integer >= {minimum}" if maximum is None else \
                f"an integer in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"expected {bound}. Received: {flag}={text!r}")
        return value
    return parse


def _seconds(flag: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value >= 0:
            raise argparse.ArgumentTypeError(
                f"expected a number of seconds >= 0. Received: {flag}={text!r}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, usage=f"{PROG} --workers N [--servers K] [--local-size L] "
        "[--host HOST] [--port PORT] -- CMD ...\n"
        f"       DMLC_ROLE=scheduler|server {PROG}\n"
        f"       DMLC_ROLE=worker {PROG} CMD ...\n"
        f"       {PROG} --join FILE [-- CMD ...]  (a worker more for a running job)\n"
        f"       srun ... {PROG} --slurm [--local-size L] -- CMD ...  (every task of a step)\n"
        f"       {PROG} k8s --workers N --image IMAGE ... -- CMD ...  (Kubernetes manifests)",
        description="Start a bpstrain job on this host (scheduler, servers and "
        "workers), or run one role of a job started by hand with BytePS's DMLC_* "
        "variables.")
    parser.add_argument("--workers", type=_int_flag("--workers", 1), metavar="N",
                        help="number of worker processes in all: N/L hosts of L processes "
                        "(the children get DMLC_NUM_WORKER=N/L, BYTEPS_LOCAL_SIZE=L)")
    parser.add_argument("--servers", type=_int_flag("--servers", 0), metavar="K",
                        help="number of dedicated summation servers (default 1; 0 only "
                        "with --mixed)")
    parser.add_argument("--local-size", type=_int_flag("--local-size", 1), metavar="L",
                        help="workers per emulated host; must divide --workers "
                        "(default: all workers on one host)")
    parser.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=None,
                        help="also run a server on every worker host (BytePS's mixed mode); "
                        "default: on when there are fewer servers than worker hosts")
    parser.add_argument("--slurm", action="store_true",
                        help="run in every task of an srun step: ranks, servers and the "
                        "scheduler follow Slurm's placement (one task per worker, or one "
                        "per node with --local-size)")
    parser.add_argument("--host", help="scheduler / node address (default 127.0.0.1)")
    parser.add_argument("--port", type=_int_flag("--port", 1, 65535), metavar="PORT",
                        help="scheduler port (default: a free port)")
    parser.add_argument("--grace", type=_seconds("--grace"), default=_procs.DEFAULT_GRACE,
                        metavar="SECONDS",
                        help="seconds between SIGTERM and SIGKILL on teardown")
    parser.add_argument("--service-timeout", type=_seconds("--service-timeout"),
                        metavar="SECONDS",
                        help="seconds the scheduler and servers may keep running after "
                        "all workers exited 0 (default 30; with --slurm: until they end)")
    parser.add_argument("--max-restarts", type=_int_flag("--max-restarts", 0), default=0, metavar="R",
                        help="with BPSTRAIN_FAULT_TOLERANCE=1: start a worker that exits non-zero "
                        "again, R times in all; it rejoins the running job in its place at the "
                        "others' next state.commit() (default 0; this host's launcher only)")
    parser.add_argument("--join", metavar="FILE",
                        help="add a worker to a running job started with BPSTRAIN_FAULT_TOLERANCE=1: "
                        "FILE is the join file its launcher printed (its workers see it as "
                        "$BPSTRAIN_JOIN_FILE); CMD defaults to the job's. It takes a departed "
                        "worker's place or, under BPSTRAIN_MAX_WORKERS, a new rank")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD",
                        help="worker command, after --")
    return parser


def _check_cmd(cmd: Sequence[str], env: Mapping[str, str]) -> None:
    if not cmd:
        raise UsageError("no worker command given; put it after `--`, e.g. "
                         f"`{PROG} --workers 2 -- python train.py`. Received: CMD=[]")
    if shutil.which(cmd[0], path=env.get("PATH")) is None:
        raise UsageError(f"worker command {cmd[0]!r} is not an executable file or on "
                         f"PATH. Received: CMD={list(cmd)}")


def _run_local(args: argparse.Namespace, cmd: list[str], environ: Mapping[str, str]) -> int:
    _check_cmd(cmd, environ)
    local_size = args.local_size
    if local_size is not None and args.workers % local_size:
        raise UsageError(
            "--workers must be a multiple of --local-size (each emulated host runs "
            f"--local-size workers). Received: --workers={args.workers}, "
            f"--local-size={local_size}")
    servers = 1 if args.servers is None else args.servers
    if servers == 0 and args.mixed is not True:
        raise UsageError("--servers 0 needs --mixed (servers on the worker hosts). "
                         "Received: --servers=0")
    service_timeout = 30.0 if args.service_timeout is None else args.service_timeout
    return launch_local(cmd, args.workers, servers, local_size, env=dict(environ),
                        host=args.host or "127.0.0.1", port=args.port, grace=args.grace,
                        service_timeout=service_timeout, mixed=args.mixed,
                        max_restarts=args.max_restarts)


def _run_slurm(args: argparse.Namespace, cmd: list[str], environ: Mapping[str, str]) -> int:
    from bpstrain.errors import ConfigError
    from bpstrain.launch.slurm import launch_slurm
    for flag, value in (("--workers", args.workers), ("--servers", args.servers),
                        ("--host", args.host), ("--max-restarts", args.max_restarts or None)):
        if value is not None:
            raise UsageError(f"{flag} does not apply with --slurm: the step's tasks and nodes "
                             "give the workers, servers and addresses. "
                             f"Received: {flag}={value}")
    _check_cmd(cmd, environ)
    try:
        return launch_slurm(cmd, environ, args.local_size, args.port, args.mixed, args.grace,
                            args.service_timeout)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def _run_join(args: argparse.Namespace, cmd: list[str], environ: Mapping[str, str]) -> int:
    from bpstrain.errors import ConfigError
    from bpstrain.launch._join import read_join_file
    for flag, value in (("--workers", args.workers), ("--servers", args.servers), ("--slurm", args.slurm or None),
                        ("--local-size", args.local_size), ("--host", args.host), ("--port", args.port),
                        ("--mixed", args.mixed), ("--max-restarts", args.max_restarts or None)):
        if value is not None:
            raise UsageError(f"{flag} does not apply with --join: the join file gives the job. "
                             f"Received: {flag}={value}")
    try:
        job, job_cmd = read_join_file(args.join)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    env = {k: v for k, v in environ.items() if k not in ("DMLC_WORKER_ID", "BPSTRAIN_HOST_ID")}
    env.update(job, DMLC_ROLE="worker")
    return _run_worker(cmd or job_cmd, env)


def _die_with_parent(environ: Mapping[str, str]) -> None:
    """Asks Linux to SIGTERM this role process when the launching process dies.

    The launcher starts roles directly with ``sys.executable`` (no wrapper), so
    the launching pid is our parent until it dies.
    """
    parent = environ.get("BPSTRAIN_LAUNCH_PARENT", "")
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes
    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(parent):  # It died before prctl took effect.
        raise SystemExit(f"{PROG}: the process that started this role (pid {parent}) is "
                         "gone; exiting")


def _run_role(role: str, environ: Mapping[str, str]) -> int:
    from bpstrain.errors import BpsError, ConfigError  # lazily: keeps --help fast
    _die_with_parent(environ)
    try:
        from bpstrain.roles import run_role
        run_role(role, environ)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    except BpsError as exc:
        sys.stderr.write(f"{PROG}: {role} failed: {exc}\n")
        return 1
    except ImportError as exc:
        sys.stderr.write(f"{PROG}: cannot run the {role}: bpstrain's engine failed to "
                         f"import ({exc}); build/install bpstrain with its C++ extension.\n")
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


def _run_worker(cmd: list[str], environ: Mapping[str, str]) -> int:
    from bpstrain.config.env import read_env
    from bpstrain.errors import ConfigError
    if not cmd:
        raise UsageError("DMLC_ROLE=worker needs the worker command, e.g. "
                         f"`{PROG} python train.py`. Received: CMD=[]")
    _check_cmd(cmd, environ)
    try:
        cluster = read_env(environ)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    if "BYTEPS_LOCAL_RANK" in environ or cluster.local_size == 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvpe(cmd[0], cmd, dict(environ))  # Signals and exit status go straight through.
    from bpstrain.launch._worker_host import run_local_ranks
    return run_local_ranks(cmd, environ, cluster.worker_id, cluster.local_size)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Entry point of ``python -m bpstrain.launch``.

    Args:
        argv: Arguments without the program name; default ``sys.argv[1:]``.
        environ: Environment; default ``os.environ``.

    Returns:
        The exit status (see the module docstring and :func:`launch_local`).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    environ = os.environ if environ is None else environ
    if argv[:1] == ["k8s"] and "DMLC_ROLE" not in environ:
        from bpstrain.launch.k8s import main as k8s_main
        return k8s_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)  # SystemExit(2) with a message on bad flags.
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else list(args.cmd)
    try:
        if args.join is not None:
            return _run_join(args, cmd, environ)
        if args.slurm:
            return _run_slurm(args, cmd, environ)
        if args.workers is not None:
            return _run_local(args, cmd, environ)
        given = [f for f, v in (("--servers", args.servers), ("--local-size", args.local_size),
                                ("--host", args.host), ("--port", args.port),
                                ("--mixed", args.mixed)) if v is not None]
        role = environ.get("DMLC_ROLE")
        if given:
            raise UsageError(f"{given[0]} only applies with --workers N (a local job). "
                             f"Received: {' '.join(argv)}")
        if role is None:
            raise UsageError("nothing to launch: pass --workers N ... -- CMD for a local "
                             "job, or set DMLC_ROLE to scheduler, server or worker. "
                             f"Received: argv={argv}, DMLC_ROLE unset")
        if role not in _ROLES:
            raise UsageError(f"DMLC_ROLE must be one of {', '.join(_ROLES)}. "
                             f"Received: DMLC_ROLE={role!r}")
        if role == "worker":
            return _run_worker(cmd, environ)
        return _run_role(role, environ)
    except UsageError as exc:
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return USAGE_EXIT
