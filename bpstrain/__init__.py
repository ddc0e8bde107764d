"""bpstrain: distributed training with a BytePS-style parameter-server engine.

Framework adapters live in :mod:`bpstrain.torch`, :mod:`bpstrain.tensorflow` and
:mod:`bpstrain.keras`; the framework-neutral engine facade in :mod:`bpstrain.engine`.
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import bpstrain` stays cheap and needs no torch.
    if name in ("Trainer",):
        from bpstrain.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'bpstrain' has no attribute {name!r}")
