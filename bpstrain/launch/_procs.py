"""Child processes with prefixed output, group teardown and a supervisor loop.

Every child runs in its own session (``start_new_session=True``, or ``setsid()`` of
its own), so its process group id equals its pid and signalling the group also
reaches grandchildren (e.g. a data-loader pool or a shell pipeline started by the
user's command). This is the project's one process supervision: the benchmarks'
jobs and the Trainer's local cluster stop their processes with :func:`stop_children`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator, Mapping, Sequence, TextIO

DEFAULT_GRACE = 5.0
"""Seconds between SIGTERM and SIGKILL when stopping children."""

_write_lock = threading.Lock()


class LaunchInterrupted(BaseException):
    """Raised in the main thread when the launcher receives SIGTERM or SIGHUP.

    A ``BaseException`` (like ``KeyboardInterrupt``) so ``except Exception``
    blocks in user callbacks cannot swallow it.

    Attributes:
        signum: The signal that was received.
    """

    def __init__(self, signum: int):
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


def exit_code(returncode: int) -> int:
    """Maps a ``Popen.returncode`` to a shell-style exit status (signal N -> 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def log(message: str) -> None:
    """Writes one launcher message to stderr, prefixed with ``[launch]``."""
    with _write_lock:
        sys.stderr.write(f"[launch] {message}\n")
        sys.stderr.flush()


class ProcessGroup:
    """A direct child that leads its own process group (its pid is the group id).

    The one teardown of the project (:func:`stop_children`) works on these: the
    launcher's :class:`Child`, the benchmarks' :class:`Watched` processes and the
    Trainer's ``multiprocessing`` workers. A subclass says whether the child is still
    running and how to wait for it.

    Args:
        label: Name used in messages, e.g. ``"worker 1"``.
        pid: The child's pid (= its process group id once it leads its session).
    """

    def __init__(self, label: str, pid: int):
        self.label, self.pid = label, pid

    def running(self) -> bool:
        """True until the direct child has exited (and was reaped)."""
        raise NotImplementedError

    def wait(self, timeout: float | None) -> bool:
        """Waits up to ``timeout`` seconds for the direct child; True once it exited."""
        raise NotImplementedError

    def signal_group(self, sig: int) -> bool:
        """Sends ``sig`` to the child's process group.

        A child that starts its own session late (a ``multiprocessing`` worker calls
        ``setsid()`` itself) gets the signal directly until then.

        Returns:
            False when no process of the group is left.
        """
        try:
            os.killpg(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            # No such group (yet), or the id was taken over by an unrelated process.
            pass
        if not self.running():
            return False
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def group_alive(self) -> bool:
        """True while the child or any process left in its group is alive."""
        if self.running():
            return True
        return self.signal_group(0) and _group_has_live_member(self.pid)

    def join_output(self, timeout: float = 2.0) -> None:
        """Waits until what the group printed has been handled (nothing to do here)."""


class Watched(ProcessGroup):
    """A ``subprocess.Popen`` started in its own session, reaped by a waiter thread.

    Args:
        label: Name used in messages.
        proc: The process; it must have been started with ``start_new_session=True``.
        on_exit: Called from the waiter thread once the process has exited.
    """

    def __init__(self, label: str, proc: subprocess.Popen,
                 on_exit: Callable[["Watched"], None] | None = None):
        super().__init__(label, proc.pid)
        self.proc = proc
        self._on_exit = on_exit
        self.exited = threading.Event()
        self._waiter = threading.Thread(target=self._wait, daemon=True,
                                        name=f"bpstrain-wait-{label}")
        self._waiter.start()

    @property
    def returncode(self) -> int | None:
        """The ``Popen`` return code once the waiter has reaped it, else ``None``."""
        return self.proc.returncode if self.exited.is_set() else None

    def running(self) -> bool:
        """True until the waiter has reaped the process."""
        return not self.exited.is_set()

    def wait(self, timeout: float | None) -> bool:
        """Waits for the waiter to reap the process; True once it has."""
        return self.exited.wait(timeout)

    def _wait(self) -> None:
        self.proc.wait()
        self.exited.set()
        if self._on_exit is not None:
            self._on_exit(self)


class Child(Watched):
    """One process in its own session whose output is relayed line by line.

    The child's stdout and stderr stay apart (so ``2>/dev/null`` on the launcher
    works): a reader thread per stream prefixes every line with ``[label]`` and
    writes it to ``output`` / ``errors`` (``sys.stdout`` / ``sys.stderr`` looked up
    at write time, so notebook redirection works). A waiter thread reaps the
    process and calls ``on_exit(child)``.

    Once the supervisor has decided to stop the job it calls :meth:`mute`: what a
    child prints while it is being stopped (a scheduler noticing that the workers
    went away, a server's "failed" line) is a consequence of the stop, not news,
    and would blame whichever peer happened to close its connection first.

    Args:
        label: Name used in the prefix and in messages, e.g. ``"worker 1"``.
        cmd: Command line.
        env: Complete environment for the process.
        on_exit: Called from the waiter thread once the process has exited.
        output: Text stream for the relayed stdout lines; ``None`` means ``sys.stdout``.
        errors: Text stream for the relayed stderr lines; ``None`` means ``output``
            when that is given (one captured stream), else ``sys.stderr``.
        die_with_parent: Linux only: the child gets SIGKILL when the thread that started
            it dies (``PR_SET_PDEATHSIG``), so a launcher killed outright leaves no
            process of its own behind (e.g. a Slurm task killed with ``kill -9``).

    Raises:
        OSError: When the command cannot be started (not found, not executable).
    """

    def __init__(self, label: str, cmd: Sequence[str], env: Mapping[str, str],
                 on_exit: Callable[["Child"], None] | None = None,
                 output: TextIO | None = None, errors: TextIO | None = None,
                 die_with_parent: bool = False):
        self.cmd = list(cmd)
        self._output = output
        self._errors = errors if errors is not None else output
        self.muted = threading.Event()
        proc = subprocess.Popen(
            self.cmd, env=dict(env), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=_kill_when_parent_dies() if die_with_parent else None)
        self.label, self.proc = label, proc  # the relays need them before the waiter runs
        self._readers = [threading.Thread(target=self._relay, args=(pipe, is_err), daemon=True,
                                          name=f"bpstrain-relay-{label}-{name}")
                         for pipe, is_err, name in ((proc.stdout, False, "out"),
                                                    (proc.stderr, True, "err"))]
        for reader in self._readers:
            reader.start()
        super().__init__(label, proc, on_exit)

    def mute(self) -> None:
        """Drops the rest of this child's output (it is being stopped on purpose)."""
        self.muted.set()

    def _relay(self, stream, is_err: bool) -> None:
        prefix = f"[{self.label}] "
        with stream as pipe:
            for raw in iter(pipe.readline, b""):
                if self.muted.is_set():
                    continue  # keep draining so the child never blocks on a full pipe
                text = raw.decode("utf-8", errors="replace")
                if not text.endswith("\n"):
                    text += "\n"
                if is_err:
                    out = self._errors if self._errors is not None else sys.stderr
                else:
                    out = self._output if self._output is not None else sys.stdout
                with _write_lock:
                    try:
                        out.write(prefix + text)
                        out.flush()
                    except (OSError, ValueError):
                        pass  # Our stream is gone (closed pipe); keep draining the child.

    def join_output(self, timeout: float = 2.0) -> None:
        """Waits until the relays have written everything the group printed."""
        deadline = time.monotonic() + timeout
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))


def _kill_when_parent_dies() -> Callable[[], None] | None:
    """A ``preexec_fn`` that arms ``PR_SET_PDEATHSIG`` = SIGKILL (``None`` off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork, not in the child
    parent = os.getpid()

    def arm() -> None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
    return arm


def mute(children: Sequence[ProcessGroup]) -> None:
    """Drops the further output of children that are about to be stopped on purpose."""
    for child in children:
        if isinstance(child, Child):
            child.mute()


def _live_processes():
    """(pid, ppid, pgrp) of every live (not zombie) process; None without procfs."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    found = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # Exited while we looked.
        if fields[0] != b"Z":  # fields: state, ppid, pgrp
            found.append((int(entry), int(fields[1]), int(fields[2])))
    return found


def child_pids(parent: int) -> list[int]:
    """Pids of the live children of process ``parent`` ([] without procfs)."""
    return [pid for pid, ppid, _ in _live_processes() or () if ppid == parent]


def _group_has_live_member(pgid: int) -> bool:
    """False when every process of group ``pgid`` is a zombie.

    Orphaned grandchildren are re-parented to init, and some container inits
    reap only every second or two; their zombies must not delay teardown.
    """
    live = _live_processes()
    if live is None:
        return True  # No procfs: trust killpg(pgid, 0).
    return any(pgrp == pgid for _, _, pgrp in live)


def stop_children(children: Sequence[ProcessGroup], grace: float = DEFAULT_GRACE) -> None:
    """Stops every child and its group: SIGTERM, then SIGKILL after ``grace`` s.

    Returns once the direct children are reaped and their groups are empty (or
    SIGKILL was sent); a second Ctrl-C meanwhile is ignored so teardown finishes.

    Args:
        children: Children to stop; ones that already exited are fine.
        grace: Seconds to wait after SIGTERM before sending SIGKILL.
    """
    with shield_signals():
        alive = [c for c in children if c.group_alive() and c.signal_group(signal.SIGTERM)]
        _wait_groups(alive, time.monotonic() + grace)
        killed = [c for c in alive if c.group_alive() and c.signal_group(signal.SIGKILL)]
        # SIGKILL is delivered asynchronously; wait so callers see no survivors.
        _wait_groups(killed, time.monotonic() + 5.0)
        for child in children:
            child.join_output(1.0)


def _wait_groups(children: Sequence[ProcessGroup], deadline: float) -> None:
    """Waits until every child and its process group are gone, or ``deadline``."""
    for child in children:
        child.wait(max(0.0, deadline - time.monotonic()))
    # Grandchildren were re-parented to init, so we cannot wait on them; group
    # emptiness can only be polled.
    while time.monotonic() < deadline and any(c.group_alive() for c in children):
        time.sleep(0.02)


@contextlib.contextmanager
def shield_signals() -> Iterator[None]:
    """Ignores SIGINT/SIGTERM in the block (main thread only) so cleanup completes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Turns SIGTERM/SIGHUP into :class:`LaunchInterrupted` (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, _frame):
        raise LaunchInterrupted(signum)

    saved = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def supervise(workers: Sequence[Child], services: Sequence[Child], events: queue.Queue,
              grace: float = DEFAULT_GRACE, service_timeout: float = 30.0,
              services_exit: bool = True, tolerate_worker_failures: bool = False,
              survivable: Sequence[Child] = (),
              restart: Callable[[Child], Child | None] | None = None) -> int:
    """Waits for a job to finish and tears it down; the launcher's main loop.

    The job fails as soon as any child exits non-zero: everything is stopped and
    that child's exit code returned. Once all workers exited 0, services get
    ``service_timeout`` seconds to exit on their own (they do once every worker
    shut down); one still running then is stopped with a note, not a failure.
    Ctrl-C / SIGTERM of the launcher stops everything and returns 128+signal.

    Args:
        workers: Worker children; all must exit 0.
        services: Scheduler and server children.
        events: Queue that receives each child (from ``on_exit``) as it exits.
        grace: SIGTERM-to-SIGKILL delay for teardown.
        service_timeout: How long services may outlive the workers.
        services_exit: False for services that serve job after job (they never exit on
            their own): they are stopped as soon as every worker has exited 0.
        tolerate_worker_failures: ``comm.fault_tolerance``: a worker that exits non-zero
            left the job and the others go on; the job fails only when no worker
            finishes (exit 0).
        survivable: Services whose exit the job survives (under ``comm.fault_tolerance``
            the scheduler: the workers and servers go on without it; and a server of
            several: its partitions move to the others).
        restart: With ``tolerate_worker_failures``: called with a worker that exited
            non-zero; returns its replacement (which joins the running job in its
            place), or None when no restart is left.

    Returns:
        The exit status for the launcher.
    """
    everyone = [*workers, *services]
    pending = {id(w) for w in workers}
    lives = len(workers)  # worker processes started: one per rank, plus restarts
    failed_workers: list = []  # exit codes of workers that left (fault tolerance)
    try:
        with terminate_raises():
            deadline = None
            while pending or any(not s.exited.is_set() for s in services):
                timeout = 1.0 if deadline is None else deadline - time.monotonic()
                if timeout <= 0:
                    left = ", ".join(s.label for s in services if not s.exited.is_set())
                    log(f"{left} still running {service_timeout:g}s after all workers "
                        "finished; stopping")
                    break
                try:
                    child = events.get(timeout=min(timeout, 1.0))
                except queue.Empty:
                    continue
                code = exit_code(child.proc.returncode)
                if any(child is c for c in survivable) and pending:
                    log(f"{child.label} exited with code {code}; fault tolerance: " +
                        ("the workers and servers go on without it (no worker can leave or join the job "
                         "from now on)" if child.label == "scheduler" else
                         "its partitions move to the other servers"))
                    continue
                if code != 0 and tolerate_worker_failures and id(child) in pending:
                    pending.discard(id(child))
                    failed_workers.append(code)
                    again = restart(child) if restart is not None and len(pending) > 0 else None
                    if again is not None:
                        log(f"{child.label} exited with code {code}; fault tolerance: restarted it, it "
                            "joins the job at the others' next admission (state.commit())")
                        everyone.append(again)
                        pending.add(id(again))
                        lives += 1
                        continue
                    if len(failed_workers) < lives:
                        log(f"{child.label} exited with code {code}; fault tolerance: the job goes on "
                            f"with the other workers")
                        if not pending and deadline is None:
                            deadline = time.monotonic() + service_timeout
                        if not pending and not services_exit:
                            break
                        continue
                if code != 0:
                    others = [c for c in everyone if c is not child and not c.exited.is_set()]
                    mute(others)  # their "peer closed its connection" lines are consequences
                    log(f"{child.label} exited with code {code}; stopping the other "
                        f"{len(others)} process(es)")
                    stop_children(everyone, grace)
                    return code
                pending.discard(id(child))
                if not pending and not services_exit:
                    break
                if not pending and deadline is None:
                    deadline = time.monotonic() + service_timeout
    except (KeyboardInterrupt, LaunchInterrupted) as exc:
        signum = exc.signum if isinstance(exc, LaunchInterrupted) else signal.SIGINT
        mute(everyone)
        log(f"interrupted ({signal.Signals(signum).name}); stopping all processes")
        stop_children(everyone, grace)
        return 128 + signum
    stop_children(everyone, grace)
    return 0
