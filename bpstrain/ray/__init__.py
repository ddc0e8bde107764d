"""bpstrain on Ray (``pip install "bpstrain[ray]"``): :class:`RayExecutor`, in the shape of
``horovod.ray.RayExecutor``, starts the scheduler and summation servers as CPU-only actors
and the workers as actors placed by placement groups; see :mod:`bpstrain.ray._executor`.
"""

try:
    import ray as _ray  # noqa: F401
except ImportError as _err:  # pragma: no cover - depends on the install
    raise ImportError('bpstrain.ray needs Ray: pip install "bpstrain[ray]" (ray 2.60). '
                      f"Received: {_err}") from None

from bpstrain.ray._executor import RayExecutor, RayExecutorError, RaySettings

__all__ = ["RayExecutor", "RayExecutorError", "RaySettings"]
