"""Keras ResNet-50 on synthetic images, data-parallel with bpstrain (any Keras 3 backend).

Run on 2 local workers (the launcher starts scheduler, server and workers)::

    python -m bpstrain.launch --workers 2 -- \\
        python -m bpstrain.keras.examples.resnet50_synthetic --steps 10

``KERAS_BACKEND=torch`` (set before the command) trains with PyTorch instead of
TensorFlow. The lines marked ``# bpstrain`` are all that differs from single-process
Keras: init, wrap the optimizer, add the callback. Each worker prints its samples/s
at the end (the benchmark ``python -m bpstrain.bench.keras_resnet`` collects them).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def synthetic_data(samples: int, image_size: int, classes: int, seed: int):
    """Random images and labels; each rank draws its own (its "shard")."""
    rng = np.random.default_rng(seed)
    x = rng.random((samples, image_size, image_size, 3), dtype=np.float32)
    return x, rng.integers(0, classes, size=samples)


def step_timer():
    """A Keras callback that records the wall-clock time at the end of every batch."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    return StepTimer()


def train(batch_size: int = 16, image_size: int = 64, steps: int = 10, warmup_steps: int = 2,
          classes: int = 10, base_lr: float = 0.001, warmup_epochs: int = 0,
          threads: int = 0, verbose: bool = True) -> dict:
    """Trains ResNet-50 for one epoch of ``steps`` batches per worker.

    Args:
        batch_size: Images per worker per step.
        image_size: Side of the square input images.
        steps: Batches per worker (the first ``warmup_steps`` are not timed).
        warmup_steps: Untimed batches (tracing, first allocations).
        classes: Output classes.
        base_lr: Learning rate of one worker; scaled by the number of workers.
        warmup_epochs: Learning-rate warm-up epochs (BytePSCallback).
        threads: CPU threads of the backend per worker; 0 keeps its default.
        verbose: Keras progress bar on rank 0.

    Returns:
        ``{"rank", "size", "samples_per_s", "step_s"}`` of this worker over the timed steps.
    """
    if steps <= warmup_steps:
        raise ValueError(f"steps must exceed warmup_steps. Received: steps={steps}, "
                         f"warmup_steps={warmup_steps}")
    import keras

    import bpstrain.keras as bps

    _set_threads(keras.backend.backend(), threads)
    bps.init()                                                              # bpstrain
    model = keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3),
                                        classes=classes)
    optimizer = keras.optimizers.SGD(base_lr * bps.size(), momentum=0.9)
    model.compile(optimizer=bps.DistributedOptimizer(optimizer),            # bpstrain
                  loss="sparse_categorical_crossentropy")
    x, y = synthetic_data(steps * batch_size, image_size, classes, seed=bps.rank())
    timer = step_timer()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
              callbacks=[bps.BytePSCallback(warmup_epochs=warmup_epochs), timer],  # bpstrain
              verbose=1 if verbose and bps.rank() == 0 else 0)
    timed = timer.ends[warmup_steps - 1:] if warmup_steps else timer.ends
    step_s = (timed[-1] - timed[0]) / (len(timed) - 1)
    result = {"rank": bps.rank(), "size": bps.size(), "step_s": step_s,
              "samples_per_s": batch_size / step_s}
    bps.shutdown()
    return result


def _set_threads(backend: str, threads: int) -> None:
    if threads <= 0:
        return
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    elif backend == "torch":
        import torch

        torch.set_num_threads(threads)


def main(argv=None) -> int:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m bpstrain.keras.examples.resnet50_synthetic")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--warmup-epochs", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    result = train(args.batch_size, args.image_size, args.steps, args.warmup_steps,
                   warmup_epochs=args.warmup_epochs, threads=args.threads)
    print(f"rank {result['rank']} of {result['size']}: {result['samples_per_s']:.1f} "
          f"samples/s ({result['step_s'] * 1000:.0f} ms/step)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
