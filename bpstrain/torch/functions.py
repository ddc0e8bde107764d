"""Broadcast helpers: model parameters, optimizer state and arbitrary objects.

    bps.broadcast_parameters(model.state_dict(), root_rank=0)   # buffers included
    bps.broadcast_optimizer_state(optimizer, root_rank=0)
    epoch = bps.broadcast_object(epoch, root_rank=0)
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Iterable, List, Tuple

import torch

from bpstrain import engine
from bpstrain.torch import ops

# Names repeat from call to call: a name used with another shape (two models sharing
# "0.weight", a longer pickle) is declared afresh by the engine, on every rank.


def broadcast_parameters(params, root_rank: int = 0, prefix: str = "broadcast_parameters") -> None:
    """Overwrites every tensor in ``params`` with ``root_rank``'s value, in place.

    Args:
        params: ``model.state_dict()`` (a mapping, integer buffers included),
            ``model.named_parameters()`` (pairs) or a list of tensors.
        root_rank: the rank whose values win.
        prefix: name prefix of the broadcasts (change it only to run two at once).

    Raises:
        ValueError: ``params`` is none of the above.
    """
    if isinstance(params, dict) or hasattr(params, "keys"):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError("broadcast_parameters takes model.state_dict(), model.named_parameters() "
                         f"or a list of tensors. Received: {type(params).__name__}")
    handles = []
    for index, (name, tensor) in enumerate(items):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast_parameters expects tensors. Received: {name}="
                             f"{type(tensor).__name__}")
        key = f"{prefix}.{name if name is not None else index}"
        handles.append(ops.broadcast_async_(tensor, root_rank, key))
    for handle in handles:
        ops.synchronize(handle)


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str = None) -> Any:
    """Returns ``root_rank``'s ``obj`` (pickled) on every rank.

    Tensors inside ``obj`` are loaded on CPU when their device does not exist here.
    Inside :func:`bpstrain.engine.to_joiners`, the ranks that keep their own get ``obj`` back.
    """
    name = name or "broadcast_object"
    payload = None
    if ops.rank() == root_rank:
        buffer = io.BytesIO()
        torch.save(obj, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
        payload = buffer.getvalue()
    payload = engine.broadcast_bytes(payload, root_rank, name)
    if ops.rank() == root_rank or payload is None:  # (None: a rank keeping its own, engine.to_joiners)
        return obj
    location = None if torch.cuda.is_available() else "cpu"
    return torch.load(io.BytesIO(payload), map_location=location, weights_only=False)


def _param_list(optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def broadcast_optimizer_state(optimizer, root_rank: int = 0,
                              prefix: str = "broadcast_optimizer_state") -> None:
    """Makes every rank's optimizer state and options equal ``root_rank``'s.

    Works for every ``torch.optim`` optimizer (and a DistributedOptimizer around one):
    options of any type (floats, bools, None, tuples, tensors) travel pickled; each
    per-parameter state tensor is broadcast in place, created on the other ranks when
    they have no state yet (e.g. root resumed from a checkpoint). Unlike Horovod no
    optimizer step is taken to create the state, so parameters are left untouched.
    """
    params = _param_list(optimizer)
    summary: List[Tuple[int, dict]] = []
    if ops.rank() == root_rank:
        for index, p in enumerate(params):
            state = optimizer.state.get(p)
            if not state:
                continue
            entry = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                    entry[key] = ("tensor", tuple(value.shape), value.dtype, value.device.type)
                else:
                    entry[key] = ("value", value)
            summary.append((index, entry))
    options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    with engine.to_all():  # only the root's summary is whole (engine.to_joiners)
        options, summary = broadcast_object((options, summary), root_rank, f"{prefix}.meta")
    if len(options) != len(optimizer.param_groups):
        raise ValueError("broadcast_optimizer_state needs the same parameter groups on every rank. "
                         f"Received: {len(optimizer.param_groups)} groups here, {len(options)} on "
                         f"rank {root_rank}")
    for group, given in zip(optimizer.param_groups, options):
        group.update(given)
    handles = []
    with torch.no_grad():
        for index, entry in summary:
            p = params[index]
            state = optimizer.state[p]
            for key, spec in entry.items():
                if spec[0] == "value":
                    state[key] = spec[1]
                    continue
                _, shape, dtype, device_type = spec
                device = p.device if device_type == p.device.type else torch.device("cpu")
                mine = state.get(key)
                if not (isinstance(mine, torch.Tensor) and tuple(mine.shape) == shape
                        and mine.dtype == dtype and mine.device == device):
                    state[key] = mine = torch.zeros(shape, dtype=dtype, device=device)
                handles.append(ops.broadcast_async_(mine, root_rank, f"{prefix}.{index}.{key}"))
    for handle in handles:
        ops.synchronize(handle)
    # Parameters the root has no state for must have none here either.
    kept = {index for index, _ in summary}
    for index, p in enumerate(params):
        if index not in kept and p in optimizer.state:
            del optimizer.state[p]
