"""Error-feedback state in the Trainer's checkpoints (``comm.compression``).

Lossy compression keeps a residual per rank (what compression dropped, added back at the
next step), and rank 0 alone writes checkpoints. So when a checkpoint is due, every rank
hands its compressors' state to rank 0 (:func:`gather`, collective), the checkpoint
stores one entry per rank (``"compression_states"``), and a resumed rank ``r`` loads
entry ``r`` into its DistributedOptimizer (:func:`restore`). Where the torch optimizer
can export the servers' residuals too (``state_dict(server_state=True)``), they travel
in the same entries and go back to the servers on resume. A Keras model's
``DistributedOptimizer`` keeps its codecs in ``_bps_compression`` (a TensorFlow
compressor with ``get_state``/``set_state``); its entry is that compressor's state.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any, List, Optional

STATE_KEY = "bpstrain_compression"  # bpstrain.torch.DistributedOptimizer's state_dict entry
CHECKPOINT_KEY = "compression_states"
_rounds = itertools.count()


def _optimizers(trainer) -> List[Any]:
    """The wrapped optimizers that may hold codec state: the torch ones, else the Keras
    model's."""
    torch_optimizers = [o for o in (getattr(trainer, "optimizers", None) or []) if o is not None]
    if torch_optimizers:
        return torch_optimizers
    keras_optimizer = getattr(getattr(trainer, "module", None), "optimizer", None)
    return [keras_optimizer] if _keras_codec(keras_optimizer) is not None else []


def _keras_codec(optimizer) -> Optional[Any]:
    codec = getattr(optimizer, "_bps_compression", None)
    return codec if callable(getattr(codec, "get_state", None)) else None


def _codec_state(optimizer) -> Optional[Any]:
    keras_codec = _keras_codec(optimizer)
    if keras_codec is not None:
        return keras_codec.get_state(server_state=True)  # collective, as below
    state_dict = optimizer.state_dict
    try:
        collective = "server_state" in inspect.signature(state_dict).parameters
    except (TypeError, ValueError):
        collective = False
    state = state_dict(server_state=True) if collective else state_dict()
    return state.get(STATE_KEY) if isinstance(state, dict) else None


def gather(trainer) -> None:
    """Collects every rank's compressor state on rank 0 (``trainer._compression_states``).

    Collective: every rank calls it at the same point (the checkpoint callback does,
    before rank 0 writes). Does nothing alone or without compression.
    """
    comm = getattr(trainer, "comm", None)
    trainer._compression_states = None
    if comm is None or not comm.distributed or comm.compression_policy() is None:
        return
    mine = [_codec_state(o) for o in _optimizers(trainer)]
    states = comm.gather_object(mine, f"trainer.compression_state.{next(_rounds)}")
    trainer._compression_states = states if trainer.is_global_zero else None


def checkpoint_entry(trainer) -> Optional[List[Any]]:
    """What :func:`gather` collected, for ``checkpoint_state`` (None: nothing)."""
    return getattr(trainer, "_compression_states", None)


def restore(trainer, ckpt: Optional[dict]) -> None:
    """Loads this rank's entry of a checkpoint into the wrapped optimizers (collective
    where the entries carry the servers' residuals)."""
    states = (ckpt or {}).get(CHECKPOINT_KEY)
    if not states:
        return
    if trainer.rank >= len(states):
        trainer.print(f"the checkpoint holds the compression state of {len(states)} ranks; "
                      f"rank {trainer.rank} starts its error feedback from zero")
        return
    optimizers = _optimizers(trainer)
    keras_codec = _keras_codec(optimizers[0]) if optimizers else None
    if keras_codec is not None:
        for codec in states[trainer.rank][:1]:
            if codec is not None:
                keras_codec.set_state(codec)  # collective where it holds server entries
        return
    plain = [ckpt.get("optimizer")] + list(ckpt.get("other_optimizers") or [])
    for optimizer, state, codec in zip(optimizers, plain, states[trainer.rank]):
        if codec is not None and state is not None:
            optimizer.load_state_dict({**state, STATE_KEY: codec})
