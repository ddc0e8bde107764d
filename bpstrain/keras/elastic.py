"""Workers that join a running Keras job (``comm.fault_tolerance``): Horovod's
``hvd.elastic.KerasState`` and ``CommitStateCallback``, without rollbacks.

    import bpstrain.keras as bps
    bps.init()                                  # a restarted worker waits here to be admitted
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    state = bps.elastic.KerasState(model)       # epoch=0, batch=0
    state.sync()                                # rank 0's state; a joiner gets the others' here
    bps.elastic.fit(state, model, x, y, batch_size=32, epochs=5,
                    callbacks=[bps.elastic.CommitStateCallback(state)])

A worker that dies leaves the job and the others go on (the servers hold no model in
synchronous training, so nothing is rolled back). A worker process started later (the
launcher's ``--max-restarts``, or a hand-started one in a free place or as a new rank
under ``comm.max_workers``) waits in ``init()`` until the others' next commit, which the
callback runs at a batch's end every ``comm.admit_every`` batches; its ``state.sync()``
meets the sync the others run inside that commit, so it starts from their weights,
optimizer variables (slots and the step counter) and position (``epoch``, ``batch``), and
:func:`fit` trains the rest of that epoch from that batch, then the later epochs.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any, Optional

import keras

from bpstrain import engine
from bpstrain.keras.callbacks import broadcast_variables


class KerasState:
    """What a worker that joins the running job needs: the model's weights, its
    optimizer's variables and plain extras (``epoch`` and ``batch``: where
    :class:`CommitStateCallback` keeps ``model.fit``; any more you pass).

    Args:
        model: A compiled Keras model (its optimizer's variables are sent too).
        **extras: plain values kept as attributes (epoch=0 and batch=0 by default).
    """

    def __init__(self, model, **extras):
        self.model = model
        extras = {"epoch": 0, "batch": 0, **extras}
        self._extras = list(extras)
        for key, value in extras.items():
            setattr(self, key, value)
        self.syncs = 0  # how many times the state was sent (at the start, then per join)

    def sync(self) -> None:
        """Makes every rank's state the root's: the lowest rank that was in the job
        before the newest join (rank 0 at the start)."""
        self._sync(contextlib.nullcontext())

    def _sync(self, variables_scope) -> None:
        root = engine.sync_root() if engine.is_initialized() else 0
        with variables_scope:
            broadcast_variables(self.model.weights, root, prefix="elastic.model")
            optimizer = getattr(self.model, "optimizer", None)
            if optimizer is not None:
                if not optimizer.built:  # a fresh process: its slots exist from here on
                    optimizer.build(self.model.trainable_variables)
                broadcast_variables(optimizer.variables, root, prefix="elastic.optimizer")
        mine = pickle.dumps({key: getattr(self, key) for key in self._extras}) \
            if engine.rank() == root else None
        for key, value in pickle.loads(engine.broadcast_bytes(mine, root, "elastic.state")).items():
            setattr(self, key, value)
        self.syncs += 1

    def commit(self) -> list:
        """A step boundary (every rank at the same step): admits the workers waiting to
        join, then sends them the state. Returns the ranks that joined."""
        joined = engine.admit()
        if joined:
            # The workers in the job hold the root's variables already: only the
            # joiners download them.
            self._sync(engine.to_joiners())
        return joined


class CommitStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch``/``state.batch`` where ``model.fit`` is and commits the state
    at a batch's end every ``batches_per_commit`` batches (default ``comm.admit_every``).
    """

    def __init__(self, state: KerasState, batches_per_commit: Optional[int] = None):
        super().__init__()
        self.state = state
        every = batches_per_commit or (engine.options().get("admit_every", 1) if engine.is_initialized() else 1)
        self.every = max(1, int(every))
        self.offset = 0  # batches of this epoch trained before this fit (set by elastic.fit)

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self.offset + batch + 1
        if self.state.batch % self.every == 0:
            self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch, self.state.batch, self.offset = epoch + 1, 0, 0


def fit(state: KerasState, model, x, y=None, *, batch_size: int, epochs: int, callbacks=(),
        **kwargs) -> Any:
    """``model.fit`` from where ``state`` stands: the rest of epoch ``state.epoch`` from
    batch ``state.batch`` (``x``/``y`` arrays, sliced there), then the later epochs.

    Every rank must see its data in the same order each epoch (``shuffle=False`` is
    passed; shuffle the arrays yourself if needed), so that a joiner's slice is where
    the epoch stands. Returns the last ``model.fit`` History (None when nothing was left).
    """
    callbacks = list(callbacks)
    commits = [cb for cb in callbacks if isinstance(cb, CommitStateCallback)]
    kwargs["shuffle"] = False
    history = None
    if state.batch and int(state.batch) * batch_size >= len(x):  # sent at an epoch's last batch
        state.epoch, state.batch = state.epoch + 1, 0
    if state.batch and state.epoch < epochs:
        start = int(state.batch) * batch_size
        for cb in commits:
            cb.offset = int(state.batch)
        history = model.fit(x[start:], None if y is None else y[start:], batch_size=batch_size,
                            epochs=state.epoch + 1, initial_epoch=state.epoch, callbacks=callbacks, **kwargs)
    if state.epoch < epochs:
        history = model.fit(x, y, batch_size=batch_size, epochs=epochs, initial_epoch=state.epoch,
                            callbacks=callbacks, **kwargs)
    return history
