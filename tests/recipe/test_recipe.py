"""Recipes: shipped YAMLs validate, the locator, and the `python -m bpstrain.recipe` CLI."""

import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

import bpstrain.recipe as recipe
from bpstrain.config import ConfigError
from bpstrain.recipe import RecipeNotFoundError, list_recipes, load_recipe
from bpstrain.recipe.__main__ import main

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


def test_the_required_recipes_exist():
    assert {"resnet50", "vgg16", "digits"} <= set(list_recipes())
    assert set(SHIPPED) <= set(list_recipes())


@pytest.mark.parametrize("name", SHIPPED)
def test_every_recipe_validates_and_sets_the_comm_knobs(name):
    raw = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
    assert {"partition_bytes", "priority", "numa"} <= set(raw["comm"])
    cfg = load_recipe(name)
    assert cfg.model.name and cfg.data.name
    assert recipe.describe_recipe(name)


@pytest.mark.parametrize("name", ["resnet50", "vgg16"])
def test_image_recipes_default_to_synthetic_data_and_report_throughput(name):
    from bpstrain.models import uses_synthetic_data

    cfg = load_recipe(name)
    assert uses_synthetic_data(cfg.data) and cfg.trainer.throughput
    assert cfg.data.name == "synthetic"  # what --print shows is what runs
    folder = load_recipe(name, ["data.name=image_folder", "data.path=/some/folder"])
    assert not uses_synthetic_data(folder.data)
    with pytest.raises(ConfigError, match="Add data.name=image_folder"):
        load_recipe(name, ["data.path=/some/folder"])  # would silently train on noise


def test_cli_print_of_an_image_recipe_shows_synthetic_data(capsys):
    assert main(["resnet50", "--print"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["name"] == "synthetic" and printed["data"]["path"] is None


def test_cli_device_cuda_without_cuda_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    assert main(["digits", "trainer.device=cuda", "cluster.workers=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "no CUDA device" in err


def test_digits_recipe_builds_model_and_data():
    import torch

    from bpstrain.models import build_datasets, build_model

    cfg = load_recipe("digits", ["model.kwargs.hidden=8"])
    train, val = build_datasets(cfg)
    x, _ = train[0]
    assert build_model(cfg)(x[None]).shape == (1, 10)
    assert isinstance(x, torch.Tensor) and val is not None


def test_overrides_and_path_recipes(tmp_path):
    assert load_recipe("resnet50", ["cluster.workers=2"]).cluster.workers == 2
    path = tmp_path / "mine.yaml"
    path.write_text("trainer:\n  epochs: 4\n")
    assert load_recipe(str(path)).trainer.epochs == 4
    assert load_recipe(path).trainer.epochs == 4


def test_unknown_recipe_lists_the_available_ones():
    with pytest.raises(RecipeNotFoundError) as info:
        load_recipe("resnet5")
    message = str(info.value)
    assert "Did you mean 'resnet50'" in message and "digits" in message
    assert isinstance(info.value, ConfigError)


def test_a_misspelt_model_name_fails_when_the_recipe_loads():
    # Checked by the recipe layer against bpstrain.models: the config layer knows no models.
    with pytest.raises(ConfigError, match=r"Did you mean 'resnet50'.*Received: model.name='resnet5'"):
        load_recipe("resnet50", ["model.name=resnet5"])


def test_checkout_recipes_come_first_in_a_source_tree():
    # An editable install's package data is a build-time snapshot; the checkout is live.
    assert Path(str(recipe._search_dirs()[0])) == REPO / "recipes"


def test_an_earlier_folder_wins(tmp_path, monkeypatch):
    packaged = tmp_path / "recipes"
    packaged.mkdir()
    (packaged / "digits.yaml").write_text("# packaged copy\ntrainer:\n  epochs: 99\n")
    (packaged / "only_packaged.yaml").write_text("trainer:\n  epochs: 1\n")
    checkout = REPO / "recipes"
    monkeypatch.setattr(recipe, "_search_dirs", lambda: [packaged, checkout])
    assert "only_packaged" in list_recipes() and "resnet50" in list_recipes()
    assert load_recipe("digits").trainer.epochs == 99
    assert recipe.describe_recipe("digits") == "packaged copy"


def test_importlib_resources_locator_finds_package_data(tmp_path, monkeypatch):
    # As from a wheel: no checkout around the module, recipes only as package data.
    pkg = tmp_path / "bpstrain"
    fake_module = tmp_path / "site" / "bpstrain" / "recipe" / "__init__.py"
    monkeypatch.setattr(recipe, "__file__", str(fake_module))
    (pkg / "recipes").mkdir(parents=True)
    (pkg / "recipes" / "wheel_only.yaml").write_text("trainer:\n  epochs: 2\n")
    monkeypatch.setattr(recipe.resources, "files", lambda package: pkg)
    assert recipe._search_dirs() == [pkg / "recipes"]
    assert list_recipes() == ["wheel_only"]
    assert load_recipe("wheel_only").trainer.epochs == 2


# --------------------------------------------------------------------------- CLI


def test_cli_list(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in ("resnet50", "vgg16", "digits"):
        assert name in out


def test_cli_print_merges_overrides(capsys):
    assert main(["vgg16", "--print", "cluster.workers=3", "comm.numa=off"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["cluster"]["workers"] == 3
    assert printed["comm"]["numa"] == "off"
    assert printed["model"]["kwargs"]["num_classes"] == 1000  # interpolation resolved


@pytest.mark.parametrize("argv, expected", [
    (["nope"], "Available: "),
    (["digits", "trainer.epoch=3"], "Did you mean 'trainer.epochs'"),
    (["digits", "trainer.epochs=abc"], "expects int"),
    ([], "name a recipe"),
])
def test_cli_usage_errors_exit_2(argv, expected, capsys):
    assert main(argv) == 2
    assert expected in capsys.readouterr().err


def test_cli_without_trainer_gives_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "bpstrain.trainer", None)  # import -> ImportError
    assert main(["digits"]) == 1
    assert "bpstrain.trainer.run_recipe is not available" in capsys.readouterr().err


def test_cli_runs_the_trainer_with_the_merged_config(monkeypatch):
    seen = []
    fake = types.ModuleType("bpstrain.trainer")
    fake.run_recipe = seen.append
    monkeypatch.setitem(sys.modules, "bpstrain.trainer", fake)
    assert main(["digits", "trainer.epochs=2"]) == 0
    assert seen[0].trainer.epochs == 2 and seen[0].model.name == "digits_mlp"


@pytest.mark.timeout(60)
def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "bpstrain.recipe", "digits", "--print"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["model"]["name"] == "digits_mlp"


def test_invalid_yaml_recipe_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(bad)
