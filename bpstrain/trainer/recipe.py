"""``run_recipe(cfg)``: what ``python -m bpstrain.recipe NAME`` runs.

Builds the model (``model.*``) and data (``data.*``) a config names with
:mod:`bpstrain.models`, fits them with :class:`~bpstrain.trainer.Trainer`, and
prints samples/s and the final metrics (rank 0). The data is built inside each
worker from the config, so nothing large is pickled.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

from omegaconf import OmegaConf

from bpstrain.config import load_config
from bpstrain.trainer.callbacks.metrics import Throughput
from bpstrain.trainer.history import History

_CACHE: Dict[str, tuple] = {}


class ConfigData:
    """Picklable ``data`` for ``fit``: the ``split`` of the datasets a config describes.

    Args:
        config: A plain-dict config (``OmegaConf.to_container``).
        split: ``"train"`` or ``"val"`` (None when the config has no validation split).
    """

    def __init__(self, config: Dict[str, Any], split: str):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val'. Received: split={split!r}")
        self.config, self.split = config, split

    def __call__(self) -> Optional[Any]:
        from bpstrain.models import build_datasets

        cfg = load_config(self.config)
        key = OmegaConf.to_yaml(cfg.data) + str(cfg.trainer.seed)
        if key not in _CACHE:  # train and val come from one build_datasets call
            _CACHE.clear()
            _CACHE[key] = build_datasets(cfg)
        train, val = _CACHE[key]
        return train if self.split == "train" else val


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def run_recipe(cfg: Any) -> History:
    """Trains the model and data a (recipe) config names; prints throughput and metrics.

    Args:
        cfg: Anything :func:`bpstrain.config.load_config` accepts; ``model.name`` and
            ``data.name`` must be set.

    Returns:
        The :class:`~bpstrain.trainer.History` of the fit.
    """
    from bpstrain.models import build_model
    from bpstrain.trainer.trainer import Trainer

    cfg = load_config(cfg)
    if cfg.data.name is None or cfg.model.name is None:
        raise ValueError("A recipe needs model.name and data.name. Received: "
                         f"model.name={cfg.model.name!r}, data.name={cfg.data.name!r}")
    plain = OmegaConf.to_container(cfg, resolve=True)
    model = build_model(cfg)
    trainer = Trainer(cfg)
    start = time.perf_counter()
    history = trainer.fit(model, ConfigData(plain, "train"), ConfigData(plain, "val"))
    wall = time.perf_counter() - start
    if not trainer.is_global_zero:
        return history
    meter = trainer.callback(Throughput)
    workers = trainer.size if trainer.comm is not None else cfg.cluster.workers
    from bpstrain.models import uses_synthetic_data

    data = "synthetic data" if uses_synthetic_data(cfg.data) else cfg.data.name
    lines = [f"{cfg.model.name} on {data}: {len(history)} epochs, {workers} worker(s), "
             f"{wall:.1f} s wall"]
    if meter is not None and meter.total_time:
        lines.append(f"throughput: {meter.samples_per_s:.1f} samples/s "
                     "(all workers, training only)")
    final = {k: v for k, v in history.last.items()
             if k not in ("epoch", "epoch_time", "lr", "samples_per_s")}
    lines.append("final metrics: " + ", ".join(f"{k}={_fmt(v)}" for k, v in final.items()))
    lines.append(f"run folder: {trainer.run_dir} (config.yaml, metrics.csv)")
    if cfg.data.name == "digits" and "val_accuracy" in final:
        # The validation split: held out from training, but watched during it (early
        # stopping, best checkpoints), so it is not a test set and is not called one.
        lines.append(f"validation accuracy: {final['val_accuracy']:.4f} (the held-out "
                     f"{cfg.data.val_fraction:.0%} of sklearn digits used for validation)")
    print("\n".join(lines), flush=True)
    return history
