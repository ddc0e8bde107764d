"""Server-held weights (comm.consistency ssp:<s> / async) for adapters that hand the
engine numpy arrays (Keras, TensorFlow): push the gradients, get the weights back.

The first :meth:`ServerWeights.step` is collective: every rank sends its variables and
the servers keep rank 0's with the optimizer's hyperparameters (param_store.h); from
then on each step pushes gradients and returns the weights the servers answered with.
bpstrain.torch has its own optimizer (bpstrain/torch/server_optimizer.py), which
pushes each gradient from backward instead of all at once.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from bpstrain import engine
from bpstrain.engine import Op


def consistency() -> str:
    """The running engine's ``comm.consistency`` ("sync" when not initialised)."""
    return engine.options().get("consistency", "sync") if engine.is_initialized() else "sync"


class ServerWeights:
    """The weights of one optimizer's variables on the servers.

    Args:
        prefix: engine-name prefix; variable ``k`` is ``<prefix>.<k>``.
        spec: the servers' optimizer ("sgd momentum=0.9", "adam beta1=0.9 ...").
    """

    def __init__(self, prefix: str, spec: str):
        self.prefix, self.spec = prefix, spec
        self.initialised = False

    def step(self, grads: Sequence[np.ndarray], values: Sequence[np.ndarray], keys: Sequence[int],
             lr: float) -> List[np.ndarray]:
        """Pushes ``grads`` (of the variables ``keys``, whose current ``values`` seed the
        servers at the first call) and returns the servers' new weights, as float32."""
        if not engine.env().distributed:
            raise RuntimeError("server-held weights need a distributed job (comm.consistency ssp/async)")
        names = [f"{self.prefix}.{k}" for k in keys]
        if not self.initialised:
            handles = []
            for name, k, value in zip(names, keys, values):
                src = np.ascontiguousarray(value, dtype=np.float32)
                handles.append(engine.submit(name, "float32", src.shape or (1,), src, np.empty_like(src),
                                             Op.BROADCAST, root=0, priority=-k, param=1,
                                             server_optimizer=self.spec))
            for h in handles:
                engine.synchronize(h)
            self.initialised = True
        handles = []
        for name, k, grad in zip(names, keys, grads):
            src = np.ascontiguousarray(grad, dtype=np.float32)
            handles.append(engine.submit(name, "float32", src.shape or (1,), src, np.empty_like(src), Op.SUM,
                                         priority=-k, param=2, lr=float(lr)))
        return [np.asarray(engine.synchronize(h)).reshape(np.shape(g)) for h, g in zip(handles, grads)]
