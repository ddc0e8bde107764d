"""``fit`` from a notebook or plain script: a whole local cluster in child processes.

Scheduler and servers come from :class:`bpstrain.launch.LocalServices`; the workers
are ``multiprocessing`` processes with an explicit start method (``spawn`` unless
configured: ``fork`` is unsafe once torch or a kernel has started threads, and a
forkserver would outlive the cell). The model, data and callbacks travel as one
cloudpickle payload, so classes defined in a notebook work.

The parent shows the only progress bar (rank 0's calls arrive over a queue), and
on success loads rank 0's weights into the caller's model. Whatever happens --
success, a worker's exception, Ctrl-C -- every child is stopped before ``launch``
returns, and the scheduler's port is free again.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_mod
import shutil
import tempfile
import threading
import time
import warnings
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from bpstrain.errors import BpsError, BpsTimeoutError, PeerError, ShutdownError
from bpstrain.launch._procs import ProcessGroup
from bpstrain.trainer.history import History

_CLUSTER_VARS = ("DMLC_", "BYTEPS_", "BPSTRAIN_")
_POLL_S = 0.2
_GRACE_S = 3.0
_ROOT_CAUSE_WAIT_S = 2.0  # after a peer error, how long to wait for the failing rank's own


class Outbox:
    """A worker's end of its message pipe to the parent: ``put`` sends one message whole.

    A send writes straight into the pipe (no feeder thread to flush at exit); a lock keeps
    messages of the worker's threads (progress bar, printed lines) from interleaving. It
    pickles into the worker process with the pipe's descriptor, lock made afresh."""

    def __init__(self, conn):
        self._conn, self._lock = conn, threading.Lock()

    def __getstate__(self):
        return {"conn": self._conn}

    def __setstate__(self, state):
        self._conn, self._lock = state["conn"], threading.Lock()

    def put(self, msg) -> None:
        with self._lock:
            self._conn.send(msg)

    def close(self) -> None:
        self._conn.close()


class _Inbox:
    """The workers' messages: one pipe per worker process, read in order by a thread each
    into one local queue, which the parent reads.

    One queue shared by every worker is not safe under fault tolerance: a worker that dies
    in the middle of a put (SIGKILL, ``os._exit``) never releases the queue's write lock,
    and every other worker's put, and its exit (which flushes the queue), then waits for
    ever (CI: rank 0 exiting at its first batch hung the two that finished training). A
    multiprocessing queue per worker is not enough either: the parent holds the queue's
    write end too, so a message cut short by its writer's death leaves the reading thread
    waiting for the rest for ever. Here the parent closes its copy of each write end once
    the worker has started, so the worker's death is an end of file: its thread stops,
    with what came before delivered."""

    def __init__(self, ctx):
        self._ctx = ctx
        self._merged: queue_mod.Queue = queue_mod.Queue()
        self._readers: list = []
        self._threads: list = []
        self._closed = threading.Event()

    def new_queue(self) -> Outbox:
        """A worker process's end to send on; call :meth:`started` with it once the
        process has started."""
        reader, writer = self._ctx.Pipe(duplex=False)
        self._readers.append(reader)
        thread = threading.Thread(target=self._forward, args=(reader,), daemon=True,
                                  name="bpstrain-fit-inbox")
        thread.start()
        self._threads.append(thread)
        return Outbox(writer)

    @staticmethod
    def started(outbox: Outbox) -> None:
        """The worker holds its own copy of ``outbox`` now: drops the parent's, so that
        the worker's exit ends its pipe."""
        outbox.close()

    def _forward(self, reader) -> None:
        while not self._closed.is_set():
            try:
                if not reader.poll(_POLL_S):
                    continue
                msg = reader.recv()
            except (EOFError, OSError, ValueError, pickle.UnpicklingError):
                return  # the worker's end is closed (it exited, mid-message or not), or close()
            self._merged.put(msg)

    def get(self, timeout: float):
        """The next message of any worker; raises queue.Empty after ``timeout`` s."""
        return self._merged.get(timeout=timeout)

    def close(self) -> None:
        self._closed.set()
        for thread in self._threads:
            thread.join(timeout=2 * _POLL_S)  # each wakes from its poll within _POLL_S
        for reader in self._readers:
            reader.close()


class WorkerError(BpsError):
    """A worker failed and its exception could not be rebuilt here; carries its traceback.

    Attributes:
        rank: The failing worker.
        remote_traceback: The worker's traceback text.
    """

    def __init__(self, message: str, rank: int, remote_traceback: str):
        super().__init__(message)
        self.rank, self.remote_traceback = rank, remote_traceback


class RemoteTraceback(Exception):
    """Set as ``__cause__`` of a re-raised worker exception; its text is the traceback."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def start_method(name: str) -> str:
    """The multiprocessing start method for ``cluster.start_method``.

    ``auto`` is ``spawn``: by the time workers start, the services' output-relay
    threads run in this process (and a Jupyter kernel always has threads), so ``fork``
    is never known to be safe; ``forkserver`` works but its server outlives the call.
    """
    if name == "auto":
        return "spawn"
    if name == "fork" and threading.active_count() > 1:
        warnings.warn("cluster.start_method=fork with threads running in this process; a "
                      "forked worker may deadlock. 'spawn' is the safe choice. "
                      "Received: start_method='fork'", RuntimeWarning, stacklevel=3)
    return name


class LocalClusterLauncher:
    """Runs one :meth:`Trainer.fit` on ``cluster.workers`` child processes.

    Args:
        trainer: The parent's Trainer; its config and callbacks are sent to every worker.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.procs: List[Any] = []
        self._closed: set = set()  # ids of closed Process objects (stop() is idempotent)
        # comm.fault_tolerance: workers that left the job (their exit does not stop it)
        self._fault_tolerance = bool(trainer.config.comm.get("fault_tolerance", False))
        self._departed: set = set()
        # ... and may be started again (cluster.max_restarts), joining the running job
        self._restarts_left = int(trainer.config.cluster.get("max_restarts", 0) or 0) \
            if self._fault_tolerance else 0
        self._failed: Dict[int, str] = {}  # reported an error, to restart once it exited
        self._start_args = None  # how each worker process is started (to start it again)
        self.services = None

    def _payload(self, model: Any, data: Any, val_data: Any, folder: str) -> str:
        """Writes the cloudpickled job to a private file; returns its path.

        Through a file, not the Process arguments: spawn writes those into a pipe the
        parent itself keeps open, so a child that dies before reading them (e.g. a script
        without a ``__main__`` guard) would block the parent forever.
        """
        from bpstrain.trainer._shipping import dump_job

        config = OmegaConf.to_container(self.trainer.config, resolve=True)
        config["trainer"]["run_name"] = self.trainer.run_name  # the folder named here
        try:
            blob = dump_job((config, self.trainer.callbacks, model, data, val_data))
        except Exception as exc:
            raise TypeError(
                "Trainer.fit with cluster.workers > 1 sends the model, data and callbacks to "
                "worker processes, so they must be picklable (cloudpickle). Pass data as a "
                "callable that builds it, or set cluster.workers=1. "
                f"Received: {type(exc).__name__}: {exc}") from exc
        path = os.path.join(folder, "job.pkl")
        with open(path, "wb") as f:
            f.write(blob)
        return path

    def launch(self, model: Any, data: Any, val_data: Any) -> History:
        """Starts the cluster, supervises it and returns rank 0's history."""
        from bpstrain.launch import LocalServices
        from bpstrain.trainer._child import main, unpack_weights
        from bpstrain.trainer.callbacks.progress import TqdmSink

        if getattr(multiprocessing.current_process(), "_inheriting", False):
            raise RuntimeError(
                "Trainer.fit was called while a worker process was importing your script. "
                "With cluster.workers > 1, guard the script's entry point with "
                "`if __name__ == \"__main__\":`. Received: a call during process bootstrap")
        cfg = self.trainer.config.cluster
        method = start_method(cfg.start_method)
        ctx = multiprocessing.get_context(method)
        parent_pid = None if method == "forkserver" else os.getpid()
        folder = tempfile.mkdtemp(prefix="bpstrain-fit-")  # mode 0700: private to this user
        messages, sink = None, TqdmSink()
        try:
            payload = self._payload(model, data, val_data, folder)
            messages = _Inbox(ctx)
            extra = {"BPSTRAIN_SECRET": cfg.secret} if cfg.secret else {}
            if self._fault_tolerance:  # the scheduler decides who left, with the workers' timeout
                extra.update(BPSTRAIN_FAULT_TOLERANCE="1",
                             BPSTRAIN_TIMEOUT=str(self.trainer.config.comm.timeout))
            self.services = LocalServices(cfg.workers, cfg.servers, cfg.local_size,
                                          host=cfg.host, port=cfg.port or None, env=extra)
            self.services.start()
            self._start_args = (ctx, main, payload, messages, parent_pid)
            for i in range(cfg.workers):
                self.procs.append(self._start_worker(i))
            results = self._supervise(messages, sink)
        except KeyboardInterrupt:
            sink.close()
            sink.write("interrupted: stopping the local cluster's processes", stderr=True)
            raise
        finally:
            sink.close()
            self.stop()
            shutil.rmtree(folder, ignore_errors=True)
            if messages is not None:
                messages.close()
        # Global rank 0 sends the weights: with fault tolerance the first worker still in the job.
        rank0 = next(r for _, r in sorted(results.items()) if r.get("weights") is not None)
        unpack_weights(model, rank0["weights"])
        for cb, state in zip(self.trainer.callbacks, rank0["callbacks"]):
            cb.load_state_dict(state)
        self.trainer.history = History.from_dict(rank0["history"])
        return self.trainer.history

    def _start_worker(self, rank: int, restart: int = 0):
        """Starts worker ``rank``'s process (again, with BPSTRAIN_RESTART=k, to rejoin)."""
        ctx, main, payload, messages, parent_pid = self._start_args
        env = {k: v for k, v in self.services.worker_env(rank).items() if k.startswith(_CLUSTER_VARS)}
        if restart:
            env["BPSTRAIN_RESTART"] = str(restart)
        outbox = messages.new_queue()
        proc = ctx.Process(target=main, args=(rank, env, payload, outbox, parent_pid),
                           name=f"bpstrain-worker-{rank}")
        try:
            proc.start()
        finally:
            messages.started(outbox)
        return proc

    def _supervise(self, messages, sink) -> Dict[int, Dict[str, Any]]:
        done: Dict[int, Dict[str, Any]] = {}
        while len(done) + len(self._departed) < len(self.procs):
            try:
                self._handle(messages.get(timeout=_POLL_S), messages, sink, done)
            except queue_mod.Empty:
                self._check_alive(messages, sink, done)
        return done

    def _handle(self, msg, messages, sink, done) -> None:
        if msg[0] == "progress":
            getattr(sink, msg[1])(*msg[2], **msg[3])
        elif msg[0] == "print":
            sink.write(f"[worker {msg[1]}] {msg[3]}", stderr=msg[2] == "stderr")
        elif msg[0] == "done":
            done[msg[1]] = msg[2]
        elif msg[0] == "error":
            if self._fault_tolerance and len(self._departed) + 1 < len(self.procs) - len(done):
                if self._restarts_left:  # started again once it has exited (_check_alive)
                    self._failed[msg[1]] = f"{msg[2]}: {msg[3]}"
                    return
                self._depart(msg[1], f"{msg[2]}: {msg[3]}", sink)
                return
            sink.close()
            raise self._root_cause(msg, messages)

    def _check_alive(self, messages, sink, done) -> None:
        for service in self.services.children:
            # Exit code 0 is the normal end once every worker has left the engine; a
            # worker may still be sending its results then.
            if service.returncode not in (None, 0):
                raise PeerError(
                    f"{service.label} of the local cluster exited with code "
                    f"{service.returncode}; its output above (prefixed [{service.label}]) says "
                    f"why. Received: returncode={service.returncode}")
        for rank, proc in enumerate(self.procs):
            if rank in done or rank in self._departed or proc.exitcode is None:
                continue
            if self._fault_tolerance and proc.exitcode != 0:
                why = self._failed.pop(rank, f"exited with code {proc.exitcode}")
                if self._restarts_left and len(self._departed) + 1 < len(self.procs) - len(done):
                    self._restart(rank, why, sink)
                else:
                    self._depart(rank, why, sink)
                continue
            try:  # what it sent just before exiting may still be in the pipe
                while rank not in done:
                    self._handle(messages.get(timeout=_POLL_S), messages, sink, done)
            except queue_mod.Empty:
                raise PeerError(
                    f"worker {rank} exited with code {proc.exitcode} without reporting an "
                    "error: killed, crashed in native code, or failed while starting (its "
                    "output above says why; a script must call fit() under "
                    "`if __name__ == \"__main__\":`). Received: "
                    f"exitcode={proc.exitcode}") from None

    def _restart(self, rank: int, why: str, sink) -> None:
        """comm.fault_tolerance with cluster.max_restarts: worker ``rank`` died; a new
        process takes its place and joins at the others' next admission."""
        self._restarts_left -= 1
        restart = int(self.trainer.config.cluster.max_restarts) - self._restarts_left
        old, self.procs[rank] = self.procs[rank], self._start_worker(rank, restart)
        old.close()  # it exited: its sentinel fd goes now
        sink.write(f"worker {rank} {why}; fault tolerance: restarted it ({restart} of "
                   f"{self.trainer.config.cluster.max_restarts}), it joins the job at the others' "
                   "next admission", stderr=True)

    def _depart(self, rank: int, why: str, sink) -> None:
        """comm.fault_tolerance: worker ``rank`` left; the others go on (the engine's
        scheduler told them)."""
        self._departed.add(rank)
        if len(self._departed) >= len(self.procs):
            raise PeerError(f"every worker of the local cluster left the job; the last: worker {rank} {why}")
        sink.write(f"worker {rank} {why}; fault tolerance: the job goes on with "
                   f"{len(self.procs) - len(self._departed)} workers", stderr=True)

    def _root_cause(self, first, messages) -> BaseException:
        """The most telling failure: a peer/timeout error is often only a consequence.

        Waits briefly for a worker's own (non-peer) error, and meanwhile looks for a
        worker that died without reporting anything (killed, crashed in native code).
        """
        errors = [first]
        secondary = (PeerError.__name__, BpsTimeoutError.__name__, ShutdownError.__name__)
        deadline = time.monotonic() + _ROOT_CAUSE_WAIT_S
        silent = None
        while all(e[2] in secondary for e in errors) and time.monotonic() < deadline:
            silent = self._silent_death({e[1] for e in errors})
            if silent is not None:
                break
            try:
                msg = messages.get(timeout=_POLL_S)
            except queue_mod.Empty:
                continue
            if msg[0] == "error":
                errors.append(msg)
        chosen = next((e for e in errors if e[2] not in secondary), None)
        if chosen is not None:
            return _rebuild(*chosen[1:])
        if silent is not None:
            rank, code = silent
            return PeerError(
                f"worker {rank} exited with code {code} without reporting an error (killed, or "
                f"crashed in native code); worker {first[1]} then failed with {first[2]}: "
                f"{first[3]}. Received: exitcode={code}")
        return _rebuild(*first[1:])

    def _silent_death(self, reported) -> Optional[tuple]:
        """(rank, exit code) of a worker that exited non-zero without a message, or None."""
        for rank, proc in enumerate(self.procs):
            if rank not in reported and proc.exitcode not in (None, 0):
                return rank, proc.exitcode
        return None

    def stop(self) -> None:
        """Stops every worker (and its process group) and the services; idempotent.

        The launcher's teardown (SIGTERM, then SIGKILL after a grace period, a second
        Ctrl-C ignored meanwhile) stops workers and services together.
        """
        from bpstrain.launch._procs import mute, stop_children

        live = [(rank, p) for rank, p in enumerate(self.procs) if id(p) not in self._closed]
        services = self.services.children if self.services is not None else []
        # Whatever the services say from now on is about this stop (a worker "closed its
        # connection" because we stopped it), not about what caused it.
        mute(services)
        stop_children([*(_WorkerProcess(rank, p) for rank, p in live), *services], _GRACE_S)
        for _, proc in live:
            if proc.exitcode is not None:
                proc.close()  # releases its sentinel fd now, not at garbage collection
                self._closed.add(id(proc))
        if self.services is not None:
            self.services.stop()  # forgets its atexit hook; everything is gone already


class _WorkerProcess(ProcessGroup):
    """A ``multiprocessing`` worker as the launcher's teardown sees it (it calls
    ``setsid()`` itself at start, so until then it is signalled directly)."""

    def __init__(self, rank: int, proc):
        super().__init__(f"worker {rank}", proc.pid)
        self.proc = proc

    def running(self) -> bool:
        return self.proc.exitcode is None

    def wait(self, timeout) -> bool:
        self.proc.join(timeout)
        return self.proc.exitcode is not None


def _rebuild(rank: int, type_name: str, message: str, tb_text: str,
             pickled: Optional[bytes]) -> BaseException:
    """The worker's exception, of its own type when possible, with its traceback attached."""
    note = f"raised in worker {rank} of the local cluster; its traceback is shown above"
    exc: Optional[BaseException] = None
    if pickled is not None:
        try:
            exc = pickle.loads(pickled)
        except Exception:  # noqa: BLE001
            exc = None
    if exc is None or isinstance(exc, KeyboardInterrupt):
        exc = WorkerError(f"worker {rank} raised {type_name}: {message}\n\n{tb_text}", rank,
                          tb_text)
    exc.__cause__ = RemoteTraceback(f"\n\nTraceback of worker {rank}:\n{tb_text}")
    exc.rank, exc.remote_traceback = rank, tb_text
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    return exc
