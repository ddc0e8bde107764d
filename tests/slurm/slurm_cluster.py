"""A real Slurm cluster on this machine: munged, slurmctld and one slurmd per node.

Debian's ``slurm-wlm`` runs several ``slurmd -N NAME`` on one host. Each node gets its own
loopback address (``127.0.2.I``, in ``/etc/hosts`` and ``NodeAddr``) and slurmd port; state,
spool, logs and the munge key live in a temporary folder. Every daemon runs in the
foreground as our child and is stopped by its pid; :meth:`SlurmCluster.stop` also ends any
process that carries this cluster's ``SLURM_CONF`` (step daemons, tasks), removes the
``/etc/hosts`` lines and the folder. Needs root (slurmd runs tasks as their user, and
``/etc/hosts`` is written); install the packages with ``bash .ci/install-slurm``.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "scancel", "sinfo")
HOSTS = Path("/etc/hosts")
MARK = "# bpstrain-slurm-test"


def missing() -> str | None:
    """Why a cluster cannot be made here, or ``None``."""
    if os.geteuid() != 0:
        return "the Slurm tests start slurmd and edit /etc/hosts, which needs root"
    absent = [d for d in DAEMONS if shutil.which(d, path=_path()) is None]
    if absent:
        return (f"Slurm is not installed ({', '.join(absent)} not found); "
                "`bash .ci/install-slurm` installs slurm-wlm and munge")
    return None


def _path() -> str:
    return os.environ.get("PATH", "") + ":/usr/sbin:/sbin"


def _free_ports(count: int) -> list[int]:
    """Ports below the range the bpstrain launcher picks from (20000-32000)."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(12000, 19999)
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


class SlurmCluster:
    """``nodes`` Slurm nodes named ``bpsnode1`` … on 127.0.2.1 …; use :meth:`start`."""

    def __init__(self, nodes: int = 4, cpus: int = 4):
        self.names = [f"bpsnode{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus
        self.dir = Path(tempfile.mkdtemp(prefix="bpstrain-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        self.env.update(SLURM_CONF=str(self.conf), PATH=_path())
        self._logs: list = []

    def _write_conf(self) -> None:
        munge = self.dir / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        ctld_port, *node_ports = _free_ports(1 + len(self.names))
        d = self.dir
        lines = [
            "ClusterName=bpstrain", "SlurmctldHost=localhost", f"SlurmctldPort={ctld_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={munge}/socket",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            # Heterogeneous jobs are placed by the backfill scheduler only.
            "SchedulerType=sched/backfill", "SchedulerParameters=bf_interval=1",
            "SlurmdParameters=config_overrides",  # CPUs as written, whatever the host has
            "MpiDefault=none", "SwitchType=switch/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "ReturnToService=2",
            "KillWait=5", "InactiveLimit=0",
            # Job ids set the launcher's port: vary them from one test run to the next.
            f"FirstJobId={random.randrange(1000, 50000)}",
        ]
        for i, (name, port) in enumerate(zip(self.names, node_ports), start=1):
            lines.append(f"NodeName={name} NodeAddr=127.0.2.{i} Port={port} CPUs={self.cpus} "
                         "State=UNKNOWN")
        lines.append(f"PartitionName=test Nodes=bpsnode[1-{len(self.names)}] Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=NO")
        self.conf.write_text("\n".join(lines) + "\n")
        for sub in ("state", *(f"spool/{n}" for n in self.names)):
            (d / sub).mkdir(parents=True)

    def _add_hosts(self) -> None:
        kept = [line for line in HOSTS.read_text().splitlines()
                if MARK not in line or Path(line.split(MARK)[1].strip()).exists()]
        ours = [f"127.0.2.{i} {name} {MARK} {self.dir}"
                for i, name in enumerate(self.names, start=1)]
        HOSTS.write_text("\n".join(kept + ours) + "\n")  # in place: it may be a bind mount

    def _remove_hosts(self) -> None:
        lines = HOSTS.read_text().splitlines()
        HOSTS.write_text("\n".join(l for l in lines if f"{MARK} {self.dir}" not in l) + "\n")

    def _daemon(self, name: str, *args: str) -> None:
        log = open(self.dir / f"{name}.out", "wb")
        self._logs.append(log)
        self.procs.append(subprocess.Popen(list(args), env=self.env, stdin=subprocess.DEVNULL,
                                           stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        """Starts every daemon and waits until all nodes are idle."""
        try:
            self._write_conf()
            self._add_hosts()
            munge = self.dir / "munge"
            self._daemon("munged", "munged", "-F", "--force", f"--key-file={munge}/munge.key",
                         f"--socket={munge}/socket", f"--pid-file={munge}/munged.pid",
                         f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed")
            self._wait_for(lambda: (munge / "socket").exists(), 10, "munged's socket")
            self._daemon("slurmctld", "slurmctld", "-D", "-i", "-f", str(self.conf))
            for name in self.names:
                self._daemon(f"slurmd-{name}", "slurmd", "-D", "-N", name, "-f", str(self.conf))
            self._wait_for(self._all_idle, timeout, "every node idle in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def _all_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env,
                             capture_output=True, text=True, timeout=20)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return out.returncode == 0 and all(states.get(n) == "idle" for n in self.names)

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test cluster: no {what} after {timeout:g}s "
                                   f"(exited: {dead}); logs:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, tail: int = 30) -> str:
        """The last lines of every daemon's log, for failure messages."""
        parts = []
        for path in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def srun(self, *args: str, timeout: float = 90,
             **extra_env: str) -> subprocess.CompletedProcess:
        """``srun ARGS`` in this cluster, its output captured as text."""
        return subprocess.run(["srun", *args], env={**self.env, **extra_env},
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)

    def _our_processes(self) -> list[int]:
        """Pids (other than ours) whose environment names this cluster's SLURM_CONF."""
        needle = f"SLURM_CONF={self.conf}\0".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read() + b"\0":
                        found.append(int(entry))
            except OSError:
                continue
        return found

    def stop(self) -> None:
        """Cancels the jobs, stops every daemon by pid, removes hosts lines and the folder."""
        if any(p.poll() is None for p in self.procs[1:2]):
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env,
                           capture_output=True, timeout=20, check=False)
        for proc in reversed(self.procs):  # slurmd, slurmctld, then munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for pid in self._our_processes():  # step daemons or tasks left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for log in self._logs:
            log.close()
        if HOSTS.exists():
            self._remove_hosts()
        shutil.rmtree(self.dir, ignore_errors=True)
