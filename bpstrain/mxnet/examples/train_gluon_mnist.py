"""Gluon MNIST training, after BytePS's ``example/mxnet/train_gluon_mnist_byteps.py``.

BytePS's script with ``s/byteps/bpstrain/``; what differs: the code sits in
``main(argv)``, ``--seed`` makes runs repeat, the model summary uses the training
context (BytePS's asked for a GPU even with ``--no-cuda``), and the data: MXNet
downloads MNIST, which needs the internet, so ``--data auto`` (the default) takes
MNIST where MXNet already has its files (``~/.mxnet/datasets/mnist``) and otherwise
embedded synthetic digits: 28x28 images of ten fixed random patterns with noise
(``--data synthetic`` forces them).

    python -m bpstrain.mxnet.examples.train_gluon_mnist --epochs 1 --no-cuda     # one process
    python -m bpstrain.launch --workers 2 -- \\
        .venv-mxnet/bin/python -m bpstrain.mxnet.examples.train_gluon_mnist --no-cuda
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import numpy as np

import bpstrain.mxnet as bps  # before mxnet: it applies the numpy shim MXNet 1.9 needs

import mxnet as mx  # noqa: E402,I100
from mxnet import autograd, gluon, nd  # noqa: E402

MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
               "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MXNet MNIST Example (bpstrain)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="training batch size (default: 64)")
    parser.add_argument("--dtype", type=str, default="float32",
                        help="training data type (default: float32)")
    parser.add_argument("--epochs", type=int, default=5,
                        help="number of training epochs (default: 5)")
    parser.add_argument("--j", type=int, default=2,
                        help="number of cpu processes for dataloader")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate (default: 0.01)")
    parser.add_argument("--momentum", type=float, default=0.9,
                        help="SGD momentum (default: 0.9)")
    parser.add_argument("--no-cuda", action="store_true", default=False,
                        help="disable training on GPU (default: False)")
    parser.add_argument("--seed", type=int, default=42,
                        help="seeds initialization and shuffling (each rank its own order)")
    parser.add_argument("--data", choices=["auto", "mnist", "synthetic"], default="auto",
                        help="auto: MNIST if MXNet has its files, else synthetic digits")
    parser.add_argument("--num-samples", type=int, default=8192,
                        help="synthetic training images (test: a quarter as many)")
    parser.add_argument("--min-accuracy", type=float, default=0.96,
                        help="rank 0 fails below this validation accuracy after the last epoch")
    return parser.parse_args(argv)


def mnist_is_local() -> bool:
    root = os.path.join(mx.base.data_dir(), "datasets", "mnist")
    return all(os.path.exists(os.path.join(root, f)) for f in MNIST_FILES)


def synthetic_digits(num_samples: int, seed: int):
    """MNIST-shaped uint8 images (28, 28, 1) of ten fixed patterns plus noise, and labels."""
    patterns = np.random.RandomState(1234).rand(10, 28, 28, 1) > 0.8  # the same everywhere
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, 10, num_samples)
    images = 150 * patterns[labels] + rng.randint(0, 106, (num_samples, 28, 28, 1))
    return nd.array(images, dtype="uint8"), nd.array(labels, dtype="int32")


def get_mnist_iterator(args):
    def dummy_transform(data, label):
        im = data.astype(args.dtype, copy=False) / 255 - 0.5
        im = nd.transpose(im, (2, 0, 1))
        return im, label

    if args.data == "mnist" or (args.data == "auto" and mnist_is_local()):
        train_set = gluon.data.vision.MNIST(train=True, transform=dummy_transform)
        val_set = gluon.data.vision.MNIST(train=False, transform=dummy_transform)
    else:
        logging.info("MNIST is not on this machine: synthetic digits (%d images)",
                     args.num_samples)
        train_set = gluon.data.ArrayDataset(*synthetic_digits(args.num_samples, seed=0))
        val_set = gluon.data.ArrayDataset(*synthetic_digits(args.num_samples // 4, seed=1))
        train_set = train_set.transform(dummy_transform)
        val_set = val_set.transform(dummy_transform)
    train_iter = gluon.data.DataLoader(train_set, args.batch_size, True, num_workers=args.j,
                                       last_batch="discard")
    val_iter = gluon.data.DataLoader(val_set, args.batch_size, False, num_workers=0)
    return train_iter, val_iter, len(train_set)


def conv_nets():
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(channels=20, kernel_size=5, activation="relu"))
        net.add(gluon.nn.MaxPool2D(pool_size=2, strides=2))
        net.add(gluon.nn.Conv2D(channels=50, kernel_size=5, activation="relu"))
        net.add(gluon.nn.MaxPool2D(pool_size=2, strides=2))
        net.add(gluon.nn.Flatten())
        net.add(gluon.nn.Dense(512, activation="relu"))
        net.add(gluon.nn.Dense(10))
    return net


def evaluate(model, data_iter, context, dtype):
    metric = mx.metric.Accuracy()
    for batch in data_iter:
        data = batch[0].as_in_context(context)
        label = batch[1].as_in_context(context)
        output = model(data.astype(dtype, copy=False))
        metric.update([label], [output])
    return metric.get()


def main(argv=None):
    args = parse_args(argv)
    if not args.no_cuda and mx.context.num_gpus() == 0:
        args.no_cuda = True  # disable CUDA if there are no GPUs
    logging.basicConfig(level=logging.INFO)
    logging.info(args)

    # bpstrain: initialize, and pin the context to the local rank
    bps.init()
    mx.random.seed(args.seed)
    np.random.seed(args.seed + bps.rank())  # the DataLoader's shuffling
    train_data, val_data, train_size = get_mnist_iterator(args)
    context = mx.cpu(bps.local_rank()) if args.no_cuda else mx.gpu(bps.local_rank())
    num_workers = bps.size()

    model = conv_nets()
    model.cast(args.dtype)
    model.initialize(mx.init.MSRAPrelu(), ctx=context)
    model.summary(nd.ones((1, 1, 28, 28), ctx=context, dtype=args.dtype))  # on every rank:
    # it runs the deferred initialization, so the trainer broadcasts rank 0's values now
    model.hybridize()
    params = model.collect_params()

    # bpstrain: DistributedTrainer, a gluon.Trainer that averages gradients over workers
    optimizer_params = {"momentum": args.momentum, "learning_rate": args.lr * num_workers}
    trainer = bps.DistributedTrainer(params, "sgd", optimizer_params)

    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    metric = mx.metric.Accuracy()
    val_acc = 0.0
    for epoch in range(args.epochs):
        tic = time.time()
        metric.reset()
        for i, batch in enumerate(train_data):
            data = batch[0].as_in_context(context)
            label = batch[1].as_in_context(context)
            with autograd.record():
                output = model(data)
                loss = loss_fn(output, label)
            loss.backward()
            trainer.step(args.batch_size)
            metric.update([label], [output])
            if i % 100 == 0:
                name, acc = metric.get()
                logging.info("[Epoch %d Batch %d] Training: %s=%f", epoch, i, name, acc)

        if bps.rank() == 0:
            elapsed = time.time() - tic
            speed = train_size * num_workers / elapsed
            logging.info("Epoch[%d]\tSpeed=%.2f samples/s\tTime cost=%f", epoch, speed, elapsed)

        _, train_acc = metric.get()
        name, val_acc = evaluate(model, val_data, context, args.dtype)
        if bps.rank() == 0:
            logging.info("Epoch[%d]\tTrain: %s=%f\tValidation: %s=%f", epoch, name, train_acc,
                         name, val_acc)
        if bps.rank() == 0 and epoch == args.epochs - 1:
            assert val_acc > args.min_accuracy, \
                f"Achieved accuracy ({val_acc:f}) is lower than expected ({args.min_accuracy})"
    bps.shutdown()
    return val_acc


if __name__ == "__main__":
    main()
