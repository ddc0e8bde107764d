"""Framework-neutral grouped operations on numpy arrays, shared by the adapters.

A *group* is a list of arrays that are enqueued on the engine together, one after the
other, and only then waited for: the engine moves them concurrently (in priority order)
instead of one blocking round trip per tensor. It lives next to :mod:`bpstrain.engine`
and imports no framework, so ``bpstrain.tensorflow`` and ``bpstrain.keras`` (either
backend) share it without importing each other.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from bpstrain import engine


def push_pull_group(
    arrays: Sequence[np.ndarray],
    names: Sequence[str],
    average: bool = True,
    priorities: Optional[Sequence[int]] = None,
) -> List[np.ndarray]:
    """Sums or averages every array over all ranks; returns new arrays in input order.

    Args:
        arrays: Inputs; left unchanged.
        names: One engine tensor name per array; every rank must pass the same names.
        average: Average (True) or sum (False).
        priorities: Larger is sent sooner; default ``-index`` (the first array first).

    Raises:
        MismatchError: ranks disagree on a name's shape or dtype (raised after every
            other array of the group has completed, so the engine stays consistent).
    """
    return _run([
        lambda a=a, n=n, p=p: engine.push_pull_async(a, name=n, average=average, priority=p)
        for a, n, p in zip(_as_arrays(arrays), names, _priorities(priorities, len(arrays)))
    ])


def broadcast_group(
    arrays: Sequence[np.ndarray],
    names: Sequence[str],
    root_rank: int,
    priorities: Optional[Sequence[int]] = None,
) -> List[np.ndarray]:
    """Returns ``root_rank``'s value of every array, in input order (exact copies).

    Args:
        arrays: This rank's values (only the root's are sent).
        names: One engine tensor name per array; every rank must pass the same names.
        root_rank: The rank whose values everyone receives.
        priorities: Larger is sent sooner; default ``-index``.
    """
    return _run([
        lambda a=a, n=n, p=p: engine.broadcast_async(a, root_rank, name=n, priority=p)
        for a, n, p in zip(_as_arrays(arrays), names, _priorities(priorities, len(arrays)))
    ])


def allgather(array, name: str) -> tuple:
    """Every rank's ``array`` concatenated along axis 0, in rank order (Horovod's allgather).

    Ranks may pass different first dimensions; the other dimensions and the dtype must
    agree (else ``MismatchError`` on every rank). One push_pull of the row counts, then
    one broadcast rooted at each rank that has rows: each rank sends its rows once.

    Args:
        array: This rank's rows (at least one dimension).
        name: Engine name prefix; every rank must pass the same one.

    Returns:
        ``(gathered, counts)``: the concatenation, and the rows of each rank (int64).

    Raises:
        ValueError: a 0-d array (there is no axis to concatenate along).
    """
    array = np.asarray(array)
    if array.ndim == 0:
        raise ValueError("allgather needs an array of at least one dimension (it concatenates "
                         "along the first). Received: a 0-d value")
    rank = engine.rank()
    counts = np.zeros(engine.size(), dtype=np.int64)
    counts[rank] = array.shape[0]
    counts = push_pull_group([counts], [f"{name}.counts"], average=False)[0]
    parts = {root: np.ascontiguousarray(array) if root == rank
             else np.empty((rows, *array.shape[1:]), dtype=array.dtype)
             for root, rows in enumerate(counts.tolist()) if rows > 0}  # every rank knows counts
    received = _run([
        lambda root=root, part=part: engine.broadcast_async(part, root, name=f"{name}.{root}",
                                                            priority=-root)
        for root, part in parts.items()])
    if not received:
        return np.empty((0, *array.shape[1:]), dtype=array.dtype), counts
    return np.concatenate(received), counts


def average(array: np.ndarray, count: int) -> np.ndarray:
    """``array / count`` in the array's own dtype, as the engine's ``Op.AVERAGE`` divides:
    floating arrays exactly, integer arrays with floor division (documented semantics)."""
    array = np.asarray(array)
    if np.issubdtype(array.dtype, np.integer):
        return np.floor_divide(array, count)
    return np.divide(array, count).astype(array.dtype, copy=False)


def unique_names(names: Sequence[str]) -> List[str]:
    """Appends ``#k`` to repeated names so one group never uses a name twice.

    Unnamed TF variables are all called ``Variable:0``; within one call they are told
    apart by position, which every rank shares.
    """
    seen: dict = {}
    out = []
    for name in names:
        count = seen.get(name, 0)
        seen[name] = count + 1
        out.append(name if count == 0 else f"{name}#{count}")
    return out


def _priorities(priorities, count: int) -> List[int]:
    if priorities is None:
        return [-i for i in range(count)]
    priorities = list(priorities)
    if len(priorities) != count:
        raise ValueError(f"expected one priority per array ({count}). "
                         f"Received: {len(priorities)} priorities")
    return priorities


def _as_arrays(values) -> List[np.ndarray]:
    # Numbers and numpy scalars (epoch metrics) become 0-d arrays; arrays pass as they are.
    return [np.asarray(v) for v in values]


def _run(starters) -> List[np.ndarray]:
    # Every started handle is waited for, even after a failure: an abandoned handle
    # would keep its buffers (and a half-finished operation) alive in the engine.
    handles, start_error = [], None
    for start in starters:
        try:
            handles.append(start())
        except Exception as exc:  # noqa: BLE001 - re-raised below
            start_error = exc
            break
    results, first_error = [], start_error
    for handle in handles:
        try:
            results.append(engine.synchronize(handle))
        except Exception as exc:  # noqa: BLE001 - re-raised below
            results.append(None)
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    return results
