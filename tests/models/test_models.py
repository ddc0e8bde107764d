"""Reference models: torchvision's parameter counts, state_dict names and output shapes.

Big models are counted on the meta device (no memory, no init cost); forward passes
use batch 1 at 32x32, which adaptive pooling allows, as in torchvision.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bpstrain.models import build_model, get_model, list_models, register_model

pytestmark = pytest.mark.timeout(60)


def _meta(name, **kwargs):
    with torch.device("meta"):
        return get_model(name, **kwargs)


def _n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, count", [
    ("resnet50", 25_557_032),
    ("resnet101", 44_549_160),
    ("resnet152", 60_192_808),
    ("vgg16", 138_357_544),
    ("vgg16_bn", 138_365_992),
])
def test_parameter_counts_match_torchvision(name, count):
    assert _n_params(_meta(name)) == count


def test_num_classes_changes_only_the_head():
    assert _n_params(_meta("resnet50", num_classes=10)) == 25_557_032 - 2049 * 990


def _torchvision_resnet50_keys():
    """torchvision's naming, rebuilt independently of our implementation."""
    def bn(prefix):
        return [f"{prefix}.{s}" for s in
                ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")]
    keys = ["conv1.weight", *bn("bn1")]
    for stage, blocks in enumerate([3, 4, 6, 3], start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            for i in (1, 2, 3):
                keys += [f"{p}.conv{i}.weight", *bn(f"{p}.bn{i}")]
            if b == 0:
                keys += [f"{p}.downsample.0.weight", *bn(f"{p}.downsample.1")]
    return keys + ["fc.weight", "fc.bias"]


def test_resnet50_state_dict_keys_and_shapes():
    sd = _meta("resnet50").state_dict()
    assert sorted(sd) == sorted(_torchvision_resnet50_keys())
    assert tuple(sd["conv1.weight"].shape) == (64, 3, 7, 7)
    assert tuple(sd["layer1.0.downsample.0.weight"].shape) == (256, 64, 1, 1)
    assert tuple(sd["layer2.0.conv2.weight"].shape) == (128, 128, 3, 3)  # stride on 3x3
    assert tuple(sd["layer4.2.conv3.weight"].shape) == (2048, 512, 1, 1)
    assert tuple(sd["fc.weight"].shape) == (1000, 2048)


def test_vgg16_state_dict_keys_and_shapes():
    sd = _meta("vgg16").state_dict()
    convs = [0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28]
    expected = [f"features.{i}.{s}" for i in convs for s in ("weight", "bias")]
    expected += [f"classifier.{i}.{s}" for i in (0, 3, 6) for s in ("weight", "bias")]
    assert sorted(sd) == sorted(expected)
    assert tuple(sd["features.28.weight"].shape) == (512, 512, 3, 3)
    assert tuple(sd["classifier.0.weight"].shape) == (4096, 25088)
    assert tuple(sd["classifier.6.weight"].shape) == (1000, 4096)


def test_resnet50_forward_small_input():
    torch.manual_seed(0)
    model = get_model("resnet50", num_classes=10).eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 32, 32))
    assert out.shape == (1, 10) and torch.isfinite(out).all()


def test_vgg16_forward_small_input():
    torch.manual_seed(0)
    model = get_model("vgg16", num_classes=10).eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 32, 32))
    assert out.shape == (1, 10) and torch.isfinite(out).all()


def test_big_models_shapes_at_224_on_meta():
    for name in ("resnet50", "vgg16"):
        assert _meta(name)(torch.empty(2, 3, 224, 224, device="meta")).shape == (2, 1000)


@pytest.mark.parametrize("name", ["digits_mlp", "digits_cnn"])
def test_digits_models_train_a_step(name):
    torch.manual_seed(0)
    model = get_model(name)
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    assert model(x).shape == (4, 10)
    assert all(p.grad is not None for p in model.parameters())


def test_registry_errors_suggest():
    with pytest.raises(ValueError, match="Did you mean 'resnet50'.*Received: name='resnet5'"):
        get_model("resnet5")
    with pytest.raises(ValueError, match="Did you mean 'num_classes'.*Received: key=model"):
        get_model("digits_mlp", num_clases=3)


def test_register_model_and_build_model():
    @register_model("tiny_linear_for_test")
    def tiny(width=3):
        return torch.nn.Linear(width, 2)

    assert "tiny_linear_for_test" in list_models()
    model = build_model({"model": {"name": "tiny_linear_for_test", "kwargs": {"width": 5}}})
    assert model.in_features == 5


def test_build_model_from_config_resolves_interpolations():
    cfg = {"model": {"name": "digits_mlp",
                     "kwargs": {"num_classes": "${data.num_classes}", "hidden": 8}},
           "data": {"num_classes": 3}}
    assert build_model(cfg)(torch.zeros(1, 1, 8, 8)).shape == (1, 3)


def test_importing_models_and_config_does_not_import_torch():
    code = ("import sys, bpstrain.models, bpstrain.config; "
            "bpstrain.config.load_config({'model.name': 'resnet50'}); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   cwd=Path(__file__).resolve().parents[2])
