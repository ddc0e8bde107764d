"""A torchvision-free ``ImageFolder``: ``root/<class>/<image>`` read with PIL.

Images are resized so the short side is ``image_size * 8/7`` (256 for 224), cropped
to ``image_size`` (random crop + horizontal flip for training, centre crop for
evaluation) and normalised with the ImageNet mean/std, as the usual ImageNet
pipelines do.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def find_images(root: Path) -> Tuple[List[str], List[Tuple[Path, int]]]:
    """Classes (sorted sub-directory names) and ``(file, class index)`` samples."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"Expected an image folder laid out as root/<class>/<image>. "
            f"Received: data.path={str(root)!r} (not a directory)")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    samples = [(f, i) for i, c in enumerate(classes) for f in sorted((root / c).rglob("*"))
               if f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file()]
    if not samples:
        raise FileNotFoundError(
            f"Expected class sub-directories holding images ({', '.join(IMAGE_EXTENSIONS)}). "
            f"Received: data.path={str(root)!r} with classes {classes}")
    return classes, samples


class ImageFolderDataset(Dataset):
    """Images under ``root/<class>/`` as ``(float tensor (3, S, S), int label)``.

    Args:
        samples: ``(path, label)`` pairs, e.g. from :func:`find_images`.
        classes: class names, index = label.
        image_size: side S of the square output.
        train: random crop + flip when True, centre crop when False.
    """

    def __init__(self, samples: Sequence[Tuple[Path, int]], classes: Sequence[str],
                 image_size: int = 224, train: bool = True) -> None:
        self.samples = list(samples)
        self.classes = list(classes)
        self.image_size = image_size
        self.train = train

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int]:
        from PIL import Image  # only needed when reading real images

        path, label = self.samples[index]
        with Image.open(path) as img:
            img = img.convert("RGB")
            short = max(self.image_size, round(self.image_size * 8 / 7))
            scale = short / min(img.size)
            img = img.resize((max(short, round(img.width * scale)),
                              max(short, round(img.height * scale))), Image.BILINEAR)
            s = self.image_size
            if self.train:  # DataLoader seeds `random` per worker process
                left = random.randint(0, img.width - s)
                top = random.randint(0, img.height - s)
            else:
                left, top = (img.width - s) // 2, (img.height - s) // 2
            img = img.crop((left, top, left + s, top + s))
            if self.train and random.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
            array = (np.asarray(img, dtype=np.float32) / 255.0 - _MEAN) / _STD
        return torch.from_numpy(array.transpose(2, 0, 1).copy()), label


def image_folder_datasets(root: str, image_size: int = 224, val_fraction: float = 0.2,
                          seed: int = 0) -> Tuple[ImageFolderDataset,
                                                  Optional[ImageFolderDataset]]:
    """Train and validation sets from an image folder.

    ``root/train`` and ``root/val`` are used when both exist (the ImageNet layout);
    otherwise the images of ``root`` are split, per class, by ``val_fraction``.
    """
    root_path = Path(root)
    if (root_path / "train").is_dir() and (root_path / "val").is_dir():
        classes, train = find_images(root_path / "train")
        val_classes, val = find_images(root_path / "val")
        if val_classes != classes:
            raise ValueError(
                f"Expected train/ and val/ to hold the same classes. "
                f"Received: train={classes[:5]}..., val={val_classes[:5]}...")
        return (ImageFolderDataset(train, classes, image_size, True),
                ImageFolderDataset(val, classes, image_size, False))
    classes, samples = find_images(root_path)
    rng = random.Random(seed)
    train, val = [], []
    for label in range(len(classes)):
        files = [s for s in samples if s[1] == label]
        rng.shuffle(files)
        n_val = int(round(len(files) * val_fraction))
        val += files[:n_val]
        train += files[n_val:]
    val_set = ImageFolderDataset(val, classes, image_size, False) if val else None
    return ImageFolderDataset(train, classes, image_size, True), val_set
