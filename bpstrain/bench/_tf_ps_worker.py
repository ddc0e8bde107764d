"""The TensorFlow peer of the stragglers benchmark: ``tf.distribute``'s
ParameterServerStrategy (asynchronous: every worker's step updates the variables on
the parameter servers by itself) training the same digits MLP as
:mod:`bpstrain.bench._straggler_worker`, with the same emulated compute and stalls.

One process per task of ``TF_CONFIG`` (``chief``, ``worker``, ``ps``)::

    TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 0}}' \\
        python -m bpstrain.bench._tf_ps_worker --done-file /tmp/x/done ...

Workers and parameter servers run a ``tf.distribute.Server`` until the chief writes
``--done-file``. The chief (the coordinator) schedules ``--steps`` steps per worker
(``ClusterCoordinator`` hands each to whichever worker is free), times them with
evaluation off the clock, and prints one ``BENCH_RESULT`` line in the straggler
worker's format (``times``: the mean step of the whole run, as the coordinator does
not see single steps).

Emulated compute: each batch of a worker's input pipeline is delayed by
TF's ``SleepDataset`` (units of ``--compute-ms``; a transient stall adds
``--stall-factor`` units with probability ``--stall-prob``, the slow worker of
``persistent`` takes ``--stall-factor`` units every step), the pipeline's prefetch
injection turned off so that the delay is paid per step. The learning rate is divided
by the worker count, as bpstrain's async mode does (each push is a 1/n step).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time

import numpy as np

from bpstrain.bench import _report


def _units(args, worker: int, steps: int) -> np.ndarray:
    """Emulated compute of each step of ``worker``, in units of ``--compute-ms``."""
    rng = np.random.default_rng(31 * worker + args.seed)
    units = np.ones(steps + 64, np.int64)  # + slack: the coordinator may pull a few ahead
    if args.straggle == "transient":
        units += (rng.random(units.shape) < args.stall_prob) * int(round(args.stall_factor))
    elif args.straggle == "persistent" and worker == args.slow_rank:
        units[:] = int(round(args.stall_factor))
    return units


def serve(task: dict, cluster: dict, done_file: str) -> int:
    import tensorflow as tf

    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=task["type"],
                                  task_index=task["index"], protocol="grpc", start=True)
    while not os.path.exists(done_file):
        time.sleep(0.2)
    del server
    os._exit(0)  # the server has no clean stop; the job is over


def coordinate(args, cluster: dict) -> int:
    import tensorflow as tf

    from bpstrain.models.data import digits_dataset

    train, test = digits_dataset("train"), digits_dataset("test")
    x, y = (t.numpy() for t in train.tensors)
    x = x.reshape(len(x), -1)
    x_test, y_test = (t.numpy() for t in test.tensors)
    x_test = x_test.reshape(len(x_test), -1)
    workers = len(cluster["worker"])
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    rng = np.random.default_rng(args.seed)

    def glorot(fan_in, fan_out):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32)

    with strategy.scope():
        params = [tf.Variable(glorot(64, args.hidden)), tf.Variable(np.zeros(args.hidden, np.float32)),
                  tf.Variable(glorot(args.hidden, 10)), tf.Variable(np.zeros(10, np.float32))]
        if args.pad_mbytes > 0:
            params.append(tf.Variable(np.zeros(int(args.pad_mbytes * (1 << 20)) // 4, np.float32)))
        moments = [tf.Variable(tf.zeros_like(p)) for p in params]
    lr, momentum = args.lr / workers, args.momentum

    def logits(inputs):
        return tf.matmul(tf.nn.relu(tf.matmul(inputs, params[0]) + params[1]), params[2]) + params[3]

    def dataset_fn(context):
        wid = context.input_pipeline_id
        data = tf.data.Dataset.from_tensor_slices((x[wid::workers], y[wid::workers]))
        data = data.shuffle(2048, seed=args.seed + wid).repeat().batch(args.batch_size)
        # TF's own SleepDataset (tf.data's test transformation; no public name in 2.21).
        from tensorflow.python.data.experimental.ops.testing import sleep

        unit = sleep(int(args.compute_ms * 1000))
        delays = tf.data.Dataset.from_tensor_slices(_units(args, wid, args.steps)).flat_map(
            lambda k: tf.data.Dataset.range(k).apply(unit).batch(1 << 20))
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False
        options.autotune.enabled = False
        return tf.data.Dataset.zip((data, delays)).map(lambda batch, _: batch).with_options(options)

    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(dataset_fn)))

    @tf.function
    def step(it):
        def replica_fn(batch):
            inputs, labels = batch
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits(inputs)))
                if args.pad_mbytes > 0:
                    loss += 0.0 * tf.reduce_sum(params[4])
            for p, m, g in zip(params, moments, tape.gradient(loss, params)):
                m.assign(momentum * m + g)
                p.assign_sub(lr * m)
            return loss

        return strategy.run(replica_fn, args=(next(it),))

    def accuracy() -> float:
        weights = [p.numpy() for p in params[:4]]
        hidden = np.maximum(x_test @ weights[0] + weights[1], 0)
        return float(((hidden @ weights[2] + weights[3]).argmax(1) == y_test).mean())

    total = args.steps * workers
    chunk = args.eval_every * workers
    curve, elapsed, done = [], 0.0, 0
    coordinator.schedule(step, args=(iterator,))  # warm-up: tracing, connections (off the clock)
    coordinator.join()
    while done < total:
        n = min(chunk, total - done)
        start = time.perf_counter()
        for _ in range(n):
            coordinator.schedule(step, args=(iterator,))
        coordinator.join()
        elapsed += time.perf_counter() - start
        done += n
        curve.append([done // workers, elapsed, accuracy()])
    per_step = elapsed / args.steps
    result = {"times": [per_step] * args.steps, "wall": elapsed, "late": 0, "staleness": 0,
              "curve": curve, "batch": args.batch_size * workers, "mean_step_only": True}
    _report.emit("tf-ps", 0, 1, [result])
    with open(args.done_file, "w") as f:
        f.write("done")
    return 0


def main(argv=None) -> int:
    """Command-line entry point; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m bpstrain.bench._tf_ps_worker")
    p.add_argument("--done-file", required=True)
    p.add_argument("--steps", type=int, default=200, help="per worker")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compute-ms", type=float, default=40.0)
    p.add_argument("--straggle", choices=("none", "transient", "persistent"), default="none")
    p.add_argument("--stall-prob", type=float, default=0.1)
    p.add_argument("--stall-factor", type=float, default=2.0)
    p.add_argument("--slow-rank", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--pad-mbytes", type=float, default=0.0)
    args = p.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    config = json.loads(os.environ["TF_CONFIG"])
    if config["task"]["type"] == "chief":
        return coordinate(args, config["cluster"])
    return serve(config["task"], config["cluster"], args.done_file)


if __name__ == "__main__":
    sys.exit(main())
