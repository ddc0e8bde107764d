"""Demo data: synthetic tensors, sklearn digits, the image folder reader, build_datasets."""

import numpy as np
import pytest
import torch

from bpstrain.config import ConfigError
from bpstrain.models import (build_datasets, digits_dataset, image_folder_datasets,
                             synthetic_dataset, uses_synthetic_data)

pytestmark = pytest.mark.timeout(60)


def test_synthetic_dataset_shapes_labels_and_determinism():
    ds = synthetic_dataset(100, (3, 32, 32), num_classes=5, seed=1)
    assert len(ds) == 100
    x, y = ds[99]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert 0 <= int(y) < 5
    again = synthetic_dataset(100, (3, 32, 32), num_classes=5, seed=1)
    assert torch.equal(ds[7][0], again[7][0]) and int(ds[7][1]) == int(again[7][1])
    assert torch.equal(ds[-1][0], ds[99][0])
    with pytest.raises(IndexError):
        ds[100]


def test_synthetic_dataset_works_with_dataloader():
    loader = torch.utils.data.DataLoader(synthetic_dataset(10, (4,), 3), batch_size=4)
    x, y = next(iter(loader))
    assert x.shape == (4, 4) and y.shape == (4,) and y.dtype == torch.int64


def test_digits_dataset_split_and_standardisation():
    train, test = digits_dataset("train", seed=0), digits_dataset("test", seed=0)
    assert len(train) + len(test) == 1797
    assert len(test) == pytest.approx(0.2 * 1797, abs=1)
    x, y = train.tensors
    assert x.shape[1:] == (1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    flat = x.reshape(len(x), -1).numpy()
    assert np.allclose(flat.mean(axis=0), 0, atol=1e-4)
    assert set(np.unique(y.numpy())) == set(range(10))
    assert len(digits_dataset("all")) == 1797
    assert torch.equal(digits_dataset("val", seed=0).tensors[0], test.tensors[0])


def test_digits_dataset_bad_split():
    with pytest.raises(ValueError, match="Received: split='dev'"):
        digits_dataset("dev")


def _write_folder(root, classes=("cat", "dog"), per_class=5, size=(40, 30)):
    from PIL import Image

    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            colour = tuple(int(v) for v in np.random.default_rng(i).integers(0, 255, 3))
            Image.new("RGB", size, colour).save(root / c / f"{i}.png")
    (root / "cat" / "notes.txt").write_text("not an image")


def test_image_folder_split_and_transform(tmp_path):
    _write_folder(tmp_path)
    train, val = image_folder_datasets(str(tmp_path), image_size=16, val_fraction=0.2)
    assert train.classes == ["cat", "dog"]
    assert (len(train), len(val)) == (8, 2)
    x, y = train[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y in (0, 1)
    assert val[0][0].shape == (3, 16, 16)


def test_image_folder_train_val_layout(tmp_path):
    _write_folder(tmp_path / "train", per_class=3)
    _write_folder(tmp_path / "val", per_class=1)
    train, val = image_folder_datasets(str(tmp_path), image_size=8)
    assert (len(train), len(val)) == (6, 2)


def test_image_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="Received: data.path="):
        image_folder_datasets(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="class sub-directories"):
        image_folder_datasets(str(tmp_path))


@pytest.mark.parametrize("data, synthetic", [
    ({"name": "synthetic"}, True),
    ({"name": "image_folder"}, True),
    ({"name": "image_folder", "path": "/x"}, False),
    ({"name": "image_folder", "path": "/x", "synthetic": True}, True),
    ({"name": "digits"}, False),
    ({"name": "digits", "synthetic": True}, True),
])
def test_synthetic_auto_rule(data, synthetic):
    from bpstrain.config import load_config

    assert uses_synthetic_data(load_config({"data": data}).data) is synthetic


def test_build_datasets():
    train, val = build_datasets({"data": {"name": "digits"}})
    assert len(train) + len(val) == 1797
    train, val = build_datasets({"data": {"name": "digits", "val_fraction": 0}})
    assert len(train) == 1797 and val is None
    train, val = build_datasets({"data": {"name": "image_folder", "image_size": 32,
                                          "num_classes": 7, "synthetic_samples": 12}})
    assert len(train) == 12 and val is None and train[0][0].shape == (3, 32, 32)
    with pytest.raises(ConfigError, match="data.name"):
        build_datasets({})
    with pytest.raises(ConfigError, match="data.path"):
        build_datasets({"data": {"name": "image_folder", "synthetic": False}})


def test_build_datasets_image_folder(tmp_path):
    _write_folder(tmp_path)
    train, val = build_datasets({"data": {"name": "image_folder", "path": str(tmp_path),
                                          "image_size": 8}})
    assert len(train) == 8 and len(val) == 2
