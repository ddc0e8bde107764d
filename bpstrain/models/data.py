"""Demo and benchmark datasets that need no internet.

- :func:`synthetic_dataset`: random images and labels of any shape, cheap to index
  (like BytePS's synthetic benchmark): measures the system, not the disk.
- :func:`digits_dataset`: sklearn's bundled 8x8 digits, standardised, split.
- :func:`build_datasets`: the ``data`` section of a config -> (train, val).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from bpstrain.models._image_folder import image_folder_datasets


class SyntheticDataset(Dataset):
    """``num_samples`` pairs of a random ``float32`` tensor and a random label.

    Only ``pool`` distinct tensors are kept in memory and reused cyclically (224x224
    ImageNet-shaped samples are 600 KB each); labels are distinct per index.
    """

    def __init__(self, num_samples: int, shape: Sequence[int], num_classes: int,
                 seed: int = 0, pool: int = 32) -> None:
        if num_samples < 1 or num_classes < 1:
            raise ValueError(
                f"Expected num_samples >= 1 and num_classes >= 1. "
                f"Received: num_samples={num_samples}, num_classes={num_classes}")
        gen = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn((min(pool, num_samples), *shape), generator=gen)
        self.labels = torch.randint(num_classes, (num_samples,), generator=gen)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        index %= len(self)
        return self.inputs[index % len(self.inputs)], self.labels[index]


def synthetic_dataset(num_samples: int = 2048, shape: Sequence[int] = (3, 224, 224),
                      num_classes: int = 1000, seed: int = 0) -> SyntheticDataset:
    """Random inputs and labels, e.g. ImageNet-shaped data for throughput runs.

    Args:
        num_samples: length of the dataset.
        shape: shape of one input, e.g. ``(3, 224, 224)``.
        num_classes: labels are drawn from ``range(num_classes)``.
        seed: same seed, same data (on every rank).

    Example:
        >>> ds = synthetic_dataset(8, (3, 32, 32), 10)
        >>> x, y = ds[0]; tuple(x.shape), int(y) < 10
        ((3, 32, 32), True)
    """
    return SyntheticDataset(num_samples, tuple(shape), num_classes, seed)


def digits_dataset(split: str = "train", seed: int = 0,
                   test_fraction: float = 0.2) -> TensorDataset:
    """sklearn's 1,797 8x8 handwritten digits as ``(N, 1, 8, 8)`` float32 and int64 labels.

    Pixels are standardised with the mean/std of the training split (so train and
    test share one transform); the split is stratified and fixed by ``seed``.

    Args:
        split: "train", "test" (alias "val"), or "all" (every sample, no split).
        seed: seed of the train/test split.
        test_fraction: share of the samples in the test split.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if split not in ("train", "test", "val", "all"):
        raise ValueError(
            f"Expected split 'train', 'test', 'val' or 'all'. Received: split={split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"Expected 0 < test_fraction < 1. Received: test_fraction={test_fraction}")
    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32)
    if split == "all":
        x_train, x_test, y_train, y_test = x, x, y, y
    else:
        x_train, x_test, y_train, y_test = train_test_split(
            x, y, test_size=test_fraction, random_state=seed, stratify=y)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std[std == 0] = 1.0  # border pixels that are always blank
    x_split, y_split = (x_train, y_train) if split == "train" else (x_test, y_test)
    images = torch.from_numpy(((x_split - mean) / std).reshape(-1, 1, 8, 8).astype(np.float32))
    return TensorDataset(images, torch.from_numpy(y_split.astype(np.int64)))


def uses_synthetic_data(data_cfg: Any) -> bool:
    """Whether a ``data`` section asks for synthetic data (``data.synthetic`` null = auto).

    Auto means synthetic for ``name: synthetic`` and for ``name: image_folder``
    without a ``path``; real data otherwise.
    """
    if data_cfg.synthetic is not None:
        return bool(data_cfg.synthetic)
    return data_cfg.name == "synthetic" or (data_cfg.name == "image_folder" and not data_cfg.path)


def build_datasets(cfg: Any) -> Tuple[Dataset, Optional[Dataset]]:
    """The (train, validation) datasets a config's ``data`` section describes.

    Args:
        cfg: a config accepted by :func:`bpstrain.config.load_config`.

    Returns:
        ``(train, val)``; ``val`` is None for synthetic data and when
        ``data.val_fraction`` is 0.
    """
    from bpstrain.config import ConfigError, load_config

    cfg = load_config(cfg)
    d, seed = cfg.data, cfg.trainer.seed
    if d.name is None:
        raise ConfigError(
            "data.name is not set: pass the data to Trainer.fit() or choose one of "
            "synthetic, digits, image_folder. Received: data.name=None")
    if uses_synthetic_data(d):
        if d.name == "digits":
            shape, classes = (1, 8, 8), 10
        else:
            shape, classes = (d.channels, d.image_size, d.image_size), d.num_classes
        return synthetic_dataset(d.synthetic_samples, shape, classes, seed), None
    if d.name == "digits":
        if d.val_fraction == 0:
            return digits_dataset("all", seed), None
        return (digits_dataset("train", seed, d.val_fraction),
                digits_dataset("test", seed, d.val_fraction))
    if not d.path:
        raise ConfigError(
            "data.name=image_folder with data.synthetic=false needs data.path, a folder "
            "laid out as <class>/<image>. Received: data.path=None")
    return image_folder_datasets(d.path, d.image_size, d.val_fraction, seed)
