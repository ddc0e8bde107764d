"""Entry point of a worker process that a notebook-side ``fit`` starts.

Messages to the parent (each rank's own pipe, :class:`bpstrain.trainer._local_cluster.Outbox`):

* ``("progress", method, args, kwargs)`` -- rank 0's progress-bar calls;
* ``("print", rank, stream, line)`` -- a line the worker printed (shown in the notebook,
  prefixed with the rank, rather than lost in the kernel's terminal);
* ``("done", rank, result)`` -- history, callback states and (rank 0) the weights;
* ``("error", rank, type_name, message, traceback_text, pickled_exception_or_None)``.
"""

from __future__ import annotations

import ctypes
import io
import os
import signal
import sys
import traceback
import warnings
from typing import Any, Dict, Optional

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: Optional[int]) -> None:
    """Asks Linux to SIGKILL us when the parent dies, so no worker outlives a dead kernel.

    ``parent_pid`` is None under forkserver: our parent is then the fork server, which
    itself exits with the process that started it.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return  # not Linux: the parent's teardown still stops us
    if parent_pid is not None and os.getppid() != parent_pid:  # died before prctl took effect
        os._exit(1)


class _QueueStream(io.TextIOBase):
    """A text stream that sends every completed line to the parent."""

    def __init__(self, queue, rank: int, name: str):
        self._queue, self._rank, self._name, self._buffer = queue, rank, name, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._buffer += text
        *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            self._queue.put(("print", self._rank, self._name, line))
        return len(text)

    def flush(self) -> None:
        if self._buffer:
            self._queue.put(("print", self._rank, self._name, self._buffer))
            self._buffer = ""


def pack_weights(model: Any) -> Any:
    """The trained weights in a picklable form (torch: ``torch.save`` bytes)."""
    from bpstrain.trainer.trainer import is_keras_model

    if is_keras_model(model):
        return ("keras", [w for w in model.get_weights()])
    import torch

    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buffer)
    return ("torch", buffer.getvalue())


def unpack_weights(model: Any, packed: Any) -> None:
    """Loads what :func:`pack_weights` produced into the caller's ``model``."""
    kind, blob = packed
    if kind == "keras":
        model.set_weights(blob)
        return
    import torch

    state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    model.load_state_dict(state)


def _fault_tolerance(config) -> bool:
    """Whether the config runs the job with ``comm.fault_tolerance``."""
    return bool((config.get("comm") or {}).get("fault_tolerance", False))


def main(rank: int, env: Dict[str, str], payload: str, queue,
         parent_pid: Optional[int]) -> None:
    """Runs one rank of a notebook-started job and reports to the parent.

    Args:
        rank: This worker's index (its ``DMLC_WORKER_ID`` / local rank come with ``env``).
        env: The cluster variables (``DMLC_*``, ``BYTEPS_*``, ``BPSTRAIN_*``).
        payload: Path of the cloudpickled ``(config, callbacks, model, data, val_data)``.
        queue: This rank's end of its message pipe to the parent (``put(msg)``).
        parent_pid: The parent's pid (None under forkserver), for the parent-death signal.
    """
    # Own session: a terminal's Ctrl-C reaches only the parent, which stops us in order,
    # and the parent can signal our whole group (data-loader workers included).
    try:
        os.setsid()
    except OSError:
        pass  # already a group leader (forkserver): the parent's killpg still works
    _die_with_parent(parent_pid)
    os.environ.update(env)
    sys.stdout = _QueueStream(queue, rank, "stdout")
    sys.stderr = _QueueStream(queue, rank, "stderr")
    try:
        from bpstrain.trainer._shipping import load_job
        from bpstrain.trainer.callbacks.progress import QueueSink
        from bpstrain.trainer.trainer import Trainer

        with open(payload, "rb") as f, warnings.catch_warnings():
            # A compiled Keras model whose optimizer never stepped is saved with 2 optimizer
            # variables and rebuilt with all its slots; Keras then warns that it skips
            # loading them, though there is nothing to load. (A stepped optimizer saves
            # all its variables and loads without the warning.)
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            config, callbacks, model, data, val_data = load_job(f.read())
        trainer = Trainer(config, callbacks)
        # Under fault tolerance every rank gets the sink: the one renumbered rank 0 after rank
        # 0 left draws the progress bar and writes the logs from then on.
        history = trainer.fit_rank(model, data, val_data,
                                   QueueSink(queue) if rank == 0 or _fault_tolerance(config) else None,
                                   joined=False)
        result = {"history": history.to_dict(),
                  "callbacks": [cb.state_dict() for cb in trainer.callbacks],
                  # With fault tolerance every rank sends them: rank 0 may have left the job.
                  "weights": pack_weights(model) if trainer.is_global_zero or _fault_tolerance(config)
                  else None}
        sys.stdout.flush()
        sys.stderr.flush()
        queue.put(("done", rank, result))
    except BaseException as exc:  # noqa: BLE001 -- everything goes to the parent
        sys.stdout.flush()
        sys.stderr.flush()
        # In the pipe once put returns, so the parent gets the root cause after we exit.
        queue.put(("error", rank, type(exc).__name__, str(exc), traceback.format_exc(),
                   _pickle_exception(exc)))
        queue.close()
        sys.exit(1)
    queue.close()


def _pickle_exception(exc: BaseException):
    try:
        import cloudpickle

        blob = cloudpickle.dumps(exc)
        cloudpickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
        return blob
    except Exception:  # noqa: BLE001
        return None
