"""The one place where environment variables are read and validated.

BytePS's variables keep their meaning (``DMLC_ROLE``, ``DMLC_NUM_WORKER``, ...); the
``BPSTRAIN_*`` variables are bpstrain's own knobs and mirror keys of the ``comm``
config section: which variable sets which key, and the bounds, come from the schema
(:func:`bpstrain.config.schema.comm_knobs`), the same ones the config loader applies.

BytePS's rank rules, exactly: ``DMLC_NUM_WORKER`` counts worker *hosts*, each running
``BYTEPS_LOCAL_SIZE`` processes, so the job has ``DMLC_NUM_WORKER * BYTEPS_LOCAL_SIZE``
workers and a process's rank is ``DMLC_WORKER_ID * BYTEPS_LOCAL_SIZE + BYTEPS_LOCAL_RANK``. A malformed value raises :class:`bpstrain.errors.ConfigError` naming
the variable, what it got and the expected form.

Workers started by torchrun (``DMLC_ROLE=worker`` and torchrun's ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``WORLD_SIZE``) get those where BytePS's are unset.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

from bpstrain.config import schema
from bpstrain.errors import ConfigError

ROLES = ("scheduler", "server", "worker")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclasses.dataclass(frozen=True)
class ClusterEnv:
    """A validated view of the cluster-related environment of one process."""

    role: Optional[str] = None
    num_worker_hosts: int = 1  # DMLC_NUM_WORKER: worker hosts (BytePS's meaning)
    num_servers: int = 1
    root_uri: str = "127.0.0.1"
    root_port: Optional[int] = None
    worker_id: Optional[int] = None
    server_id: Optional[int] = None
    local_rank: int = 0
    local_size: int = 1
    local_size_given: bool = False  # BYTEPS_LOCAL_SIZE was set (the scheduler learns it otherwise)
    node_host: str = ""
    host_id: str = ""  # BPSTRAIN_HOST_ID: which machine this is, when addresses do not tell
    # BPSTRAIN_LISTEN_HOST: where the scheduler and servers bind; "" = the scheduler on
    # DMLC_PS_ROOT_URI, a server on DMLC_NODE_HOST or its address toward the scheduler.
    listen_host: str = ""
    mixed_mode: bool = True  # BYTEPS_ENABLE_MIXED_MODE=0 turns the co-located share off
    force_distributed: bool = False
    # Communication knobs; None = not set in the environment (config/defaults apply).
    comm: Mapping[str, object] = dataclasses.field(default_factory=dict)

    @property
    def num_workers(self) -> int:
        """Worker processes in the job: DMLC_NUM_WORKER * BYTEPS_LOCAL_SIZE."""
        return self.num_worker_hosts * self.local_size

    @property
    def rank_hint(self) -> int:
        """rank = DMLC_WORKER_ID * BYTEPS_LOCAL_SIZE + BYTEPS_LOCAL_RANK, or -1 (assign)."""
        if self.worker_id is None:
            return -1
        return self.worker_id * self.local_size + self.local_rank

    @property
    def distributed(self) -> bool:
        """True when this process belongs to a launched job (a scheduler exists)."""
        return self.role is not None


def _get(environ: Mapping[str, str], name: str) -> Optional[str]:
    value = environ.get(name)
    return None if value is None else value.strip()


def _int(environ, name, default=None, minimum=None, maximum=None):
    raw = _get(environ, name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    bounds = []
    if minimum is not None:
        bounds.append(f">= {minimum}")
    if maximum is not None:
        bounds.append(f"<= {maximum}")
    if value is None or (minimum is not None and value < minimum) or (
        maximum is not None and value > maximum
    ):
        expect = "an integer" + (" " + " and ".join(bounds) if bounds else "")
        raise ConfigError(f"environment variable {name} must be {expect}. Received: {name}={raw!r}")
    return value


def _bool(environ, name):
    raw = _get(environ, name)
    if raw is None:
        return None
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ConfigError(f"environment variable {name} must be 0/1/true/false. Received: {name}={raw!r}")


def _comm_value(name: str, raw: str, kind: type, knob: schema.Knob):
    """The value of comm knob variable ``name``: parsed as ``kind``, checked by ``knob``."""
    try:
        if kind is bool:
            if raw.lower() not in _TRUE + _FALSE:
                raise ValueError(raw)
            return raw.lower() in _TRUE
        if kind is list:  # YAML text, as an override on the command line
            import yaml

            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError:
                raise ValueError(raw) from None
        else:
            value = kind(raw)
    except ValueError:
        what = "0/1/true/false" if kind is bool else knob.describe()
        raise ConfigError(f"environment variable {name} must be {what}. "
                          f"Received: {name}={raw!r}") from None
    try:
        return knob.check(value)
    except ValueError as err:
        raise ConfigError(f"environment variable {name} must be {err}. "
                          f"Received: {name}={raw!r}") from None


def read_comm_env(environ: Optional[Mapping[str, str]] = None) -> dict:
    """The ``comm`` options set in the environment, validated (unset ones are absent).

    Every knob's variables come from the schema; the first one set wins (e.g.
    ``BPSTRAIN_PARTITION_BYTES`` over BytePS's ``BYTEPS_PARTITION_BYTES``). The cluster
    secret, ``BPSTRAIN_SECRET``, is returned as ``secret``.

    Raises:
        ConfigError: a variable is malformed or out of range; the message names it.
    """
    env = os.environ if environ is None else environ
    options = {}
    for key, (kind, knob) in schema.comm_knobs().items():
        for name in knob.env:
            raw = _get(env, name)
            if raw:
                options[key] = _comm_value(name, raw, kind, knob)
                break
    secret = _get(env, "BPSTRAIN_SECRET")
    if secret:
        options["secret"] = secret
    return options


def _interface_address(ifname: str) -> str:
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        except OSError as exc:
            raise ConfigError(
                f"environment variable DMLC_INTERFACE names an interface without an IPv4 "
                f"address ({exc.strerror}). Received: DMLC_INTERFACE={ifname!r}"
            ) from None
    return socket.inet_ntoa(packed[20:24])


# torchrun's names for BytePS's, used where BytePS's own are unset (BytePS's win).
_TORCHRUN = (("BYTEPS_LOCAL_RANK", "LOCAL_RANK"), ("BYTEPS_LOCAL_SIZE", "LOCAL_WORLD_SIZE"),
             ("DMLC_WORKER_ID", "GROUP_RANK"))


def _with_torchrun_names(env: Mapping[str, str]) -> Mapping[str, str]:
    """A worker started by torchrun: LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK stand in
    for BYTEPS_LOCAL_RANK, BYTEPS_LOCAL_SIZE and DMLC_WORKER_ID, and WORLD_SIZE /
    LOCAL_WORLD_SIZE for DMLC_NUM_WORKER, so rank = GROUP_RANK * LOCAL_WORLD_SIZE +
    LOCAL_RANK is torchrun's RANK. Only DMLC_ROLE=worker processes read them."""
    if (_get(env, "DMLC_ROLE") or "").lower() != "worker" or not _get(env, "LOCAL_WORLD_SIZE"):
        return env
    merged = dict(env)
    for ours, theirs in _TORCHRUN:
        if not _get(env, ours) and _get(env, theirs):
            merged[ours] = env[theirs]
    world = _int(env, "WORLD_SIZE", None, minimum=1)
    local = _int(env, "LOCAL_WORLD_SIZE", None, minimum=1)
    if not _get(env, "DMLC_NUM_WORKER") and world is not None:
        if world % local:
            raise ConfigError("torchrun's WORLD_SIZE must be a multiple of LOCAL_WORLD_SIZE (the same "
                              f"number of workers on every host). Received: WORLD_SIZE={world}, "
                              f"LOCAL_WORLD_SIZE={local}")
        merged["DMLC_NUM_WORKER"] = str(world // local)
    return merged


def read_env(environ: Optional[Mapping[str, str]] = None) -> ClusterEnv:
    """Reads and validates the cluster environment.

    Args:
        environ: the mapping to read; defaults to ``os.environ``.

    Returns:
        A :class:`ClusterEnv`. ``role`` is None when the process was not launched as
        part of a job (standalone: one worker, no servers).

    Raises:
        ConfigError: a variable is malformed; the message names it.
    """
    env = os.environ if environ is None else environ
    role = _get(env, "DMLC_ROLE")
    if role is not None:
        role = role.lower()
        if role not in ROLES:
            raise ConfigError(
                "environment variable DMLC_ROLE must be one of scheduler, server, worker. "
                f"Received: DMLC_ROLE={env.get('DMLC_ROLE')!r}"
            )
    env = _with_torchrun_names(env)
    num_worker_hosts = _int(env, "DMLC_NUM_WORKER", 1, minimum=1)
    num_servers = _int(env, "DMLC_NUM_SERVER", 1, minimum=1)
    local_size = _int(env, "BYTEPS_LOCAL_SIZE", 1, minimum=1)
    local_rank = _int(env, "BYTEPS_LOCAL_RANK", 0, minimum=0)
    if local_rank >= local_size:
        raise ConfigError(
            "BYTEPS_LOCAL_RANK must be smaller than BYTEPS_LOCAL_SIZE. "
            f"Received: BYTEPS_LOCAL_RANK={local_rank}, BYTEPS_LOCAL_SIZE={local_size}"
        )
    worker_id = _int(env, "DMLC_WORKER_ID", None, minimum=0)
    if worker_id is not None and worker_id >= num_worker_hosts:
        raise ConfigError(
            "DMLC_WORKER_ID must be < DMLC_NUM_WORKER (the number of worker hosts; each runs "
            "BYTEPS_LOCAL_SIZE processes). "
            f"Received: DMLC_WORKER_ID={worker_id}, DMLC_NUM_WORKER={num_worker_hosts}"
        )
    root_port = _int(env, "DMLC_PS_ROOT_PORT", None, minimum=1, maximum=65535)
    root_uri = _get(env, "DMLC_PS_ROOT_URI") or "127.0.0.1"
    if role is not None and root_port is None:
        raise ConfigError(
            f"DMLC_ROLE={role} needs the scheduler's address: set DMLC_PS_ROOT_PORT "
            "(an integer port, e.g. 9000) and DMLC_PS_ROOT_URI (e.g. 10.0.0.1)"
        )
    node_host = _get(env, "DMLC_NODE_HOST") or ""
    interface = _get(env, "DMLC_INTERFACE")
    if not node_host and interface:
        node_host = _interface_address(interface)
    mixed = _bool(env, "BYTEPS_ENABLE_MIXED_MODE")
    return ClusterEnv(
        role=role,
        num_worker_hosts=num_worker_hosts,
        num_servers=num_servers,
        root_uri=root_uri,
        root_port=root_port,
        worker_id=worker_id,
        server_id=_int(env, "DMLC_SERVER_ID", None, minimum=0),
        local_rank=local_rank,
        local_size=local_size,
        local_size_given=bool(_get(env, "BYTEPS_LOCAL_SIZE")),
        node_host=node_host,
        host_id=_get(env, "BPSTRAIN_HOST_ID") or "",
        listen_host=_get(env, "BPSTRAIN_LISTEN_HOST") or "",
        mixed_mode=mixed is not False,
        force_distributed=bool(_bool(env, "BYTEPS_FORCE_DISTRIBUTED")),
        comm=read_comm_env(env),
    )
