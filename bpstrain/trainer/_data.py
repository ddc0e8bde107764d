"""What ``fit(model, data)`` accepts as data, and each rank's shard of it.

Accepted: a torch ``Dataset``, a ``DataLoader`` (its dataset, batch size, collate
function and worker count are reused; the sampler is replaced by a per-rank one),
an ``(x, y)`` pair of numpy arrays or tensors, or a zero-argument callable that
returns one of these (built inside each worker, so big data is never pickled).

Every rank runs the same number of training batches (the sampler pads the shard as
``DistributedSampler`` does); push_pull needs all ranks to take each step together. With
``comm.fault_tolerance`` the sampler is an :class:`ElasticTrainSampler`: the same order and
shares until a worker leaves, then what nobody consumed yet is dealt over the others.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Subset

from bpstrain.torch.elastic import ElasticSampler

log = logging.getLogger(__name__)


def _expected(what: str, data: Any) -> TypeError:
    return TypeError(
        f"{what} must be a torch Dataset, a DataLoader, an (x, y) pair of arrays, or a "
        f"callable returning one of these. Received: {type(data).__name__}")


def _to_tensor(array: Any) -> torch.Tensor:
    tensor = array if isinstance(array, torch.Tensor) else torch.as_tensor(np.asarray(array))
    if tensor.dtype == torch.float64:
        tensor = tensor.float()  # numpy's default; models are float32
    return tensor


def resolve(data: Any, what: str = "data") -> tuple:
    """Returns ``(dataset, loader_options)`` for any accepted form of ``data``."""
    if callable(data) and not isinstance(data, (Dataset, DataLoader)):
        data = data()
        if callable(data) and not isinstance(data, (Dataset, DataLoader)):
            raise _expected(f"{what}() (the callable's result)", data)
    if isinstance(data, DataLoader):
        options = {"collate_fn": data.collate_fn, "num_workers": data.num_workers}
        if data.batch_size is not None:
            options["batch_size"] = data.batch_size
        data, loader_options = data.dataset, options
    else:
        loader_options = {}
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(
            hasattr(a, "shape") for a in data):
        x, y = _to_tensor(data[0]), _to_tensor(data[1])
        if len(x) != len(y):
            raise ValueError(f"{what}: x and y must have the same length. "
                             f"Received: len(x)={len(x)}, len(y)={len(y)}")
        data = torch.utils.data.TensorDataset(x, y)
    if isinstance(data, IterableDataset):
        raise TypeError(f"{what}: an IterableDataset cannot be sharded by the Trainer; pass a "
                        "map-style Dataset. Received: " + type(data).__name__)
    if isinstance(data, (str, bytes, dict)) or not (
            hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise _expected(what, data)
    return data, loader_options


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can leave out the start of its next epoch's order.

    Attributes:
        skip: Samples to drop from the front of the next ``__iter__`` (then back to 0):
            a mid-epoch resume sets it to ``batches done x batch size``, so the loader
            yields exactly the batches the interrupted epoch had left, in its order.
    """

    skip = 0

    def __iter__(self):
        skip, self.skip = self.skip, 0
        indices = super().__iter__()
        return iter(list(indices)[skip:]) if skip else indices


class ElasticTrainSampler(ElasticSampler):
    """The Trainer's sampler under ``comm.fault_tolerance``: ``ElasticSampler``'s deal
    (until a worker leaves, the order and shares of :class:`ResumableSampler`) with the
    same ``skip`` for a mid-epoch resume. The loop calls ``record_batch`` after each batch.
    """

    skip = 0

    def __iter__(self):
        skip, self.skip = self.skip, 0
        self._follow_membership()
        if skip:
            self._done = min(skip, self._share_len())
        return super().__iter__()


def train_loader(data: Any, cfg: Any, rank: int, size: int, elastic: bool = False) -> DataLoader:
    """This rank's training DataLoader: shuffled per epoch, padded to equal length.

    Call ``loader.sampler.set_epoch(epoch)`` before each epoch for a new order. With
    ``elastic`` (fault tolerance) the shares follow the job's membership
    (:class:`ElasticTrainSampler`), and the loader runs without worker processes: they
    would draw indices of the old deal ahead of the step where the deal changes.
    """
    dataset, options = resolve(data, "data")
    if len(dataset) == 0:
        raise ValueError("data is empty; expected at least one training sample. Received: len=0")
    shuffle, seed = bool(cfg.data.shuffle), int(cfg.trainer.seed)
    num_workers = options.get("num_workers", int(cfg.data.loader_workers))
    if elastic:
        sampler = ElasticTrainSampler(dataset, shuffle=shuffle, seed=seed)
        if num_workers:
            log.warning("comm.fault_tolerance: the training DataLoader runs without worker processes "
                        "(data.loader_workers=%d): they would prefetch batches of a share that a "
                        "departing worker makes stale", num_workers)
            num_workers = 0
    else:
        sampler = ResumableSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed)
    return DataLoader(dataset, batch_size=options.get("batch_size", int(cfg.trainer.batch_size)),
                      sampler=sampler, drop_last=bool(cfg.data.drop_last),
                      num_workers=num_workers, collate_fn=options.get("collate_fn"))


def batches_left(loader: DataLoader) -> int:
    """How many batches an elastic loader's sampler still holds for this rank."""
    n = len(loader.sampler)
    return n // loader.batch_size if loader.drop_last else math.ceil(n / loader.batch_size)


def val_loader(data: Any, cfg: Any, rank: int, size: int) -> Optional[DataLoader]:
    """This rank's validation DataLoader over every size-th sample (no padding), or None."""
    if callable(data) and not isinstance(data, (Dataset, DataLoader)):
        data = data()  # may return None: e.g. a recipe without a validation split
    if data is None:
        return None
    dataset, options = resolve(data, "val_data")
    # Unpadded strided shards: metrics are summed with their counts, so they are exact.
    shard = Subset(dataset, range(rank, len(dataset), size))
    return DataLoader(shard, batch_size=options.get("batch_size", int(cfg.trainer.batch_size)),
                      shuffle=False, num_workers=options.get("num_workers",
                                                             int(cfg.data.loader_workers)),
                      collate_fn=options.get("collate_fn"))


def to_device(batch: Any, device: torch.device) -> Any:
    """Moves every tensor in a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [to_device(b, device) for b in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch (length of its first tensor)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_size_of(next(iter(batch.values())))
    return 1
