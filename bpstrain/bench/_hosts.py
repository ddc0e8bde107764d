"""Where benchmark processes run: loopback, or the hosts of an EmulatedCluster.

Both offer the same small surface (``addr``, ``popen``, ``ifname``,
``next_port``), so the job code in ``_jobs`` is written once for both.
"""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Mapping, Sequence
from typing import Protocol

from bpstrain.bench.emulated import EmulatedCluster
from bpstrain.launch.local import free_port


class Hosts(Protocol):
    """What the job runner needs from a set of hosts."""

    ifname: str

    def addr(self, i: int) -> str: ...

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen: ...

    def next_port(self) -> int: ...


class LoopbackHosts:
    """Every "host" is this machine, reached on 127.0.0.1."""

    ifname = "lo"

    def addr(self, i: int) -> str:
        """Always ``127.0.0.1``."""
        return "127.0.0.1"

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Starts ``argv`` here, in its own session so Ctrl-C reaches only the parent."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(list(argv), env=dict(env) if env is not None else None,
                                **kwargs)

    def next_port(self) -> int:
        """A port the OS reports free right now (other programs share loopback)."""
        return free_port("127.0.0.1")


class EmulatedHosts:
    """Adapts an ``EmulatedCluster``; ports come from a counter (namespaces are private)."""

    def __init__(self, cluster: EmulatedCluster, first_port: int = 23000) -> None:
        self.cluster = cluster
        self.ifname = cluster.ifname
        # A fresh port per job avoids binding next to TIME_WAIT sockets of the last job.
        self._ports = itertools.count(first_port, 7)

    def addr(self, i: int) -> str:
        """Address of emulated host ``i``."""
        return self.cluster.addr(i)

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Starts ``argv`` inside emulated host ``i``."""
        return self.cluster.popen(i, argv, env=env, **kwargs)

    def next_port(self) -> int:
        """The next unused port of this run."""
        return next(self._ports)
