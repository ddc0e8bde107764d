"""Adding a worker to a running launched job (``python -m bpstrain.launch --join FILE``).

With ``comm.fault_tolerance`` the local launcher writes a *join file*: the job's
variables that a new worker needs (the scheduler's address, the cluster secret, the
job's shape and knobs; none of one process's identity) and the workers' command, in a
directory only this user can read (0700, the file 0600), removed when the job ends. The
workers see its path as ``BPSTRAIN_JOIN_FILE``. ``--join FILE [-- CMD]`` runs CMD (default:
the job's command) as ``DMLC_ROLE=worker`` with those variables and no ``DMLC_WORKER_ID``:
the scheduler gives it the place of a worker that left or, under ``comm.max_workers``, a
new rank, and it joins at the others' next admission (``state.commit()``).

The file holds the job's secret; it is as private as the workers' own environments
(which the same user can read in ``/proc``), and gone with the job.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from bpstrain.errors import ConfigError

JOIN_FILE_VAR = "BPSTRAIN_JOIN_FILE"
# One process's identity, which a new worker must not inherit: the scheduler picks its rank.
_NOT_SHARED = ("DMLC_ROLE", "DMLC_WORKER_ID", "DMLC_SERVER_ID", "BYTEPS_LOCAL_RANK", "BPSTRAIN_HOST_ID",
               "BPSTRAIN_LAUNCH_PARENT", "BPSTRAIN_RESTART", JOIN_FILE_VAR)
_PREFIXES = ("DMLC_", "BYTEPS_", "BPSTRAIN_")
_FORMAT = 1


def write_join_file(worker_env: Mapping[str, str], cmd: Sequence[str]) -> Path:
    """Writes the join file of a job whose workers get ``worker_env`` (any worker's) and
    run ``cmd``; returns its path (in a new private directory: remove it with
    :func:`remove_join_file`)."""
    job = {k: v for k, v in worker_env.items() if k.startswith(_PREFIXES) and k not in _NOT_SHARED}
    job["BYTEPS_LOCAL_RANK"] = "0"  # a host of its own (fault tolerance runs the flat path)
    directory = Path(tempfile.mkdtemp(prefix="bpstrain-job-"))  # 0700
    path = directory / "join.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"format": _FORMAT, "env": job, "cmd": list(cmd)}, f)
    return path


def remove_join_file(path: Path) -> None:
    """Removes a join file and its directory (the job is over: nobody can join)."""
    shutil.rmtree(path.parent, ignore_errors=True)


def read_join_file(path: str) -> tuple[dict[str, str], list[str]]:
    """The job's variables and command from a join file.

    Raises:
        ConfigError: the file is missing (the job is over, or another path), unreadable
            or not a join file.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no join file at {path!r}: the job is over, or the path is not the one its "
                          f"launcher printed (its workers see it as ${JOIN_FILE_VAR})") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the join file {path!r}: {exc}") from None
    env, cmd = (data.get("env"), data.get("cmd")) if isinstance(data, dict) else (None, None)
    if (data.get("format") if isinstance(data, dict) else None) != _FORMAT or not isinstance(env, dict) \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()) \
            or not isinstance(cmd, list) or not all(isinstance(c, str) for c in cmd):
        raise ConfigError(f"{path!r} is not a join file of this bpstrain (format {_FORMAT}: "
                          "the job's variables and command)")
    return env, cmd
