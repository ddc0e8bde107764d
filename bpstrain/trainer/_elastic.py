"""Workers that join a running Trainer job (``comm.fault_tolerance``).

Every ``comm.admit_every`` optimizer steps, the workers in the job let in the workers
waiting to join (:func:`bpstrain.engine.admit`: one round trip to the scheduler, at the
same step on every rank). When some joined, the lowest rank that was in the job before
(:func:`bpstrain.engine.sync_root`) sends them, in memory, what a resume from a
mid-epoch checkpoint reads: :meth:`Trainer.checkpoint_state` (weights, optimizers, LR
schedulers, loss scaler, callbacks, history, the run's name) and where the epoch stands
(epoch, next batch, steps, the sampler's samples not consumed yet). Every rank then
deals those samples over the larger job at that same step.

The joiner is a worker process started later (``python -m bpstrain.launch
--max-restarts``, or a hand-started ``DMLC_ROLE=worker``, a new rank under
``comm.max_workers``): its ``fit`` waits in the engine's ``init`` until the others'
admission, skips the start's broadcasts and resume (the others are mid-training), meets
the send in :func:`join`, and trains from that batch on. Nothing is rolled back: the
servers hold no model, and the state of the workers in the job is whole.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional

from bpstrain import engine

STATE_NAME = "trainer.elastic.state"


def due(trainer) -> bool:
    """Whether this optimizer step is one where the workers admit joiners."""
    every = int(trainer.config.comm.get("admit_every", 1) or 1)
    return trainer.global_step % every == 0


def admit(trainer, epoch: int, next_batch: int, sampler: Any) -> bool:
    """A step boundary on every rank of the job: lets waiting workers in and, when some
    joined, sends them the state. Returns True when someone joined (the sampler was
    dealt again over the larger job)."""
    joined = engine.admit()
    if not joined:
        return False
    _sync(trainer, {"epoch": epoch, "batch": next_batch}, sampler)
    trainer.print(f"worker(s) {joined} joined the job at epoch {epoch}, batch {next_batch}: "
                  f"{trainer.size} workers")
    return True


def join(trainer, sampler: Any) -> Dict[str, Any]:
    """In a worker admitted into the running job: receives the root's state (the
    checkpoint dict plus ``position``) and deals the epoch's rest as the others do.
    The caller loads the weights and optimizers from it (as from a checkpoint)."""
    state = _sync(trainer, None, sampler)
    trainer.run_name = state["run_name"]
    position = state["position"]
    trainer.current_epoch = int(position["epoch"])
    trainer.resume_batch = int(position["batch"])
    trainer.global_step = int(position["global_step"])
    trainer.progress_step = int(position["progress_step"])
    trainer.resume_logs = dict(position["logs"])
    # Its own batches only (the epoch's metrics are summed over ranks), under the same
    # keys as the others' even if it trains no batch of this epoch: the reduction's name
    # follows them.
    trainer.resume_sums = {key: [0.0, 0.0] for key in position["sum_keys"]}
    trainer.resume_sampler = position["sampler"]
    return state


def _sync(trainer, position: Optional[Dict[str, Any]], sampler: Any) -> Optional[Dict[str, Any]]:
    """The root's position on every rank, which deals the unconsumed samples again, and
    its checkpoint state (with ``position``) on the joiners: the others hold it already
    (``engine.to_joiners``), and get None."""
    root = engine.sync_root()
    state = None
    if trainer.rank == root:
        position = dict(position, global_step=trainer.global_step, progress_step=trainer.progress_step,
                        logs=dict(trainer.logs), sum_keys=sorted(trainer.train_sums or {}),
                        sampler=sampler.state_dict())
    position = trainer.comm.broadcast_object(position, STATE_NAME + ".position", root=root)
    sampler.load_state_dict(position["sampler"])
    if trainer.rank == root:
        logs, trainer.logs = trainer.logs, {}  # the epoch is not over: not in the history
        try:
            state = trainer.checkpoint_state()
        finally:
            trainer.logs = logs
    with engine.to_joiners() if trainer.comm.distributed else contextlib.nullcontext():
        state = trainer.comm.broadcast_object(state, STATE_NAME, root=root)
    if state is not None:
        state["position"] = position
    return state
