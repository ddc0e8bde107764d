"""Per-epoch metrics of a fit, Keras-like, that can plot themselves."""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional


class History:
    """The metrics of every epoch, as returned by :meth:`Trainer.fit`.

    Attributes:
        epochs: One dict per epoch, e.g. ``{"epoch": 0, "loss": 0.4, "val_accuracy": 0.93}``.

    Example:
        >>> h = History([{"epoch": 0, "loss": 1.0}, {"epoch": 1, "loss": 0.5}])
        >>> h["loss"], h.last["loss"]
        ([1.0, 0.5], 0.5)
    """

    def __init__(self, epochs: Optional[Iterable[Dict[str, Any]]] = None):
        self.epochs: List[Dict[str, Any]] = [dict(e) for e in (epochs or [])]

    def append(self, logs: Dict[str, Any]) -> None:
        """Records one epoch's metrics (copied)."""
        self.epochs.append(dict(logs))

    @property
    def history(self) -> Dict[str, List[Any]]:
        """Keras' layout: ``{metric: [value per epoch]}`` (None where an epoch lacks it)."""
        keys: List[str] = []
        for logs in self.epochs:
            keys += [k for k in logs if k not in keys and k != "epoch"]
        return {k: [logs.get(k) for logs in self.epochs] for k in keys}

    @property
    def last(self) -> Dict[str, Any]:
        """The metrics of the last epoch ({} before the first one)."""
        return dict(self.epochs[-1]) if self.epochs else {}

    def __getitem__(self, key: str) -> List[Any]:
        history = self.history
        if key not in history:
            raise KeyError(f"No metric {key!r} in this history; available: "
                           f"{', '.join(history) or 'none'}. Received: key={key!r}")
        return history[key]

    def __len__(self) -> int:
        return len(self.epochs)

    def __repr__(self) -> str:
        last = ", ".join(f"{k}={_fmt(v)}" for k, v in self.last.items() if k != "epoch")
        return f"History({len(self)} epochs; last: {last or '-'})"

    def to_dict(self) -> Dict[str, Any]:
        """Plain, picklable form: ``{"epochs": [...]}``."""
        return {"epochs": [dict(e) for e in self.epochs]}

    @classmethod
    def from_dict(cls, state: Dict[str, Any]) -> "History":
        """Inverse of :meth:`to_dict`."""
        return cls(state.get("epochs", []))

    def plot(self, keys: Optional[Iterable[str]] = None, ax=None):
        """Plots metrics against epochs: losses on one axis, the rest on another.

        Args:
            keys: Metrics to plot; default every numeric one except timing/lr.
            ax: A matplotlib Axes (everything on it) or None for a new figure.

        Returns:
            The matplotlib Figure.
        """
        import matplotlib.pyplot as plt

        history = self.history
        if keys is None:
            skip = ("lr", "samples_per_s", "epoch_time")
            keys = [k for k, v in history.items()
                    if k not in skip and any(isinstance(x, (int, float)) for x in v)]
        keys = list(keys)
        missing = [k for k in keys if k not in history]
        if missing:
            raise KeyError(f"Cannot plot unknown metrics; available: {', '.join(history)}. "
                           f"Received: keys={missing}")
        losses = [k for k in keys if "loss" in k]
        others = [k for k in keys if k not in losses]
        if ax is not None:
            groups, axes = [keys], [ax]
        else:
            groups = [g for g in (losses, others) if g] or [[]]
            fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.5), squeeze=False)
            axes = list(axes[0])
        epochs = [e.get("epoch", i) + 1 for i, e in enumerate(self.epochs)]
        for group, axis in zip(groups, axes):
            for key in group:
                points = [(x, y) for x, y in zip(epochs, history[key])
                          if isinstance(y, (int, float)) and not math.isnan(y)]
                if points:
                    axis.plot(*zip(*points), marker="o", label=key)
            axis.set_xlabel("epoch")
            axis.grid(alpha=0.3)
            if group:
                axis.legend()
        axes[0].figure.tight_layout()
        return axes[0].figure


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)
