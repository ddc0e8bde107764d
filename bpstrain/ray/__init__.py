"""bpstrain on Ray (``pip install "bpstrain[ray]"``): :class:`RayExecutor`, in the shape of
``horovod.ray.RayExecutor``, starts the scheduler and summation servers as CPU-only actors
and the workers as actors placed by placement groups (:mod:`bpstrain.ray._executor`);
:class:`BpstrainTrainer` is Ray Train's data-parallel trainer on a bpstrain job, as
``HorovodTrainer`` (:mod:`bpstrain.ray._train`).
"""

try:
    import ray as _ray  # noqa: F401
except ImportError as _err:  # pragma: no cover - depends on the install
    raise ImportError('bpstrain.ray needs Ray: pip install "bpstrain[ray]" (ray 2.60). '
                      f"Received: {_err}") from None

from bpstrain.ray._executor import RayExecutor, RayExecutorError, RaySettings

__all__ = ["RayExecutor", "RayExecutorError", "RaySettings", "BpstrainTrainer", "BpstrainConfig"]


def __getattr__(name):
    # Lazy: Ray Train needs ray[train] (pandas, pyarrow ...), RayExecutor only ray.
    if name in ("BpstrainTrainer", "BpstrainConfig"):
        from bpstrain.ray import _train

        return getattr(_train, name)
    raise AttributeError(f"module 'bpstrain.ray' has no attribute {name!r}")
