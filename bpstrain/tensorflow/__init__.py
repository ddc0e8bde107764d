"""TensorFlow adapter: ``import bpstrain.tensorflow as bps`` (BytePS/Horovod style).

Example, a custom training loop run with
``python -m bpstrain.launch --workers 2 -- python train.py``::

    import keras
    import tensorflow as tf
    import bpstrain.tensorflow as bps

    bps.init()
    model = make_model()                  # built: its variables exist
    opt = keras.optimizers.SGD(0.01 * bps.size())
    opt.build(model.trainable_variables)  # so that its slots can be broadcast too
    bps.broadcast_variables(model.variables, root_rank=0)
    bps.broadcast_variables(opt.variables, root_rank=0)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = bps.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

``Compression.none``/``Compression.fp16`` and ``op=Average``/``op=Sum`` are taken by
``push_pull``, ``DistributedGradientTape`` and ``DistributedOptimizer`` as in Horovod, and
so are ``Compression.bf16``, the stateful codecs ``onebit()``, ``topk(r)``, ``randomk(r)``,
``dithering(s)``, ``powersgd(r)``, ``auto()`` and ``policy(...)`` (error feedback per
tensor name; see :mod:`bpstrain.tensorflow.compression`);
``allgather`` concatenates every rank's rows (first dimensions may differ), as Horovod's;
Keras scripts written for ``horovod.tensorflow.keras`` / ``byteps.tensorflow.keras``
import :mod:`bpstrain.tensorflow.keras`.

Operations work eagerly and inside ``tf.function`` (not under XLA:
``jit_compile=True`` raises ValueError). Supported dtypes: uint8, int8, int32, int64,
float16, bfloat16, float32, float64.

Errors: a shape or dtype that differs between ranks for one name raises
``bpstrain.errors.MismatchError`` (a RuntimeError) eagerly, and
``tf.errors.UnknownError`` with the same message (it begins with ``MismatchError:``)
from inside a ``tf.function``; the job stays usable either way. A dead peer raises
``PeerError`` / ``UnknownError`` likewise, and nothing waits longer than the engine's
op timeout.
"""

from bpstrain.engine import (barrier, init, is_initialized, local_rank, local_size, rank,
                             shutdown, size)
from bpstrain.errors import BpsError, MismatchError, PeerError
from bpstrain.tensorflow._ops import (Average, Sum, allgather, broadcast, check_not_xla,
                                      push_pull)
from bpstrain.tensorflow._optim import (DistributedGradientTape, DistributedOptimizer,
                                        broadcast_variables)
from bpstrain.tensorflow.compression import Compression

__all__ = [
    "Average", "BpsError", "Compression", "DistributedGradientTape", "DistributedOptimizer", "MismatchError",
    "PeerError", "allgather", "barrier", "broadcast", "broadcast_variables", "check_not_xla", "init",
    "is_initialized",
    "local_rank", "local_size", "push_pull", "rank", "shutdown", "size", "Sum",
]
