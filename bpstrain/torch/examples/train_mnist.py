"""MNIST-style training, after BytePS's ``example/pytorch/train_mnist_byteps.py``.

There is no download here: it trains the small CNN of :mod:`bpstrain.models` on
sklearn's bundled 8x8 digits (``--data synthetic`` for random data instead).

    python -m bpstrain.torch.examples.train_mnist --epochs 2            # one process
    python -m bpstrain.launch --workers 2 --servers 1 -- \
        python -m bpstrain.torch.examples.train_mnist --epochs 2        # two workers
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import bpstrain.torch as bps
from bpstrain.models import get_model
from bpstrain.models.data import digits_dataset, synthetic_dataset


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="PyTorch digits example (bpstrain)")
    p.add_argument("--batch-size", type=int, default=64, help="input batch size per worker")
    p.add_argument("--test-batch-size", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.01, help="learning rate (scaled by size())")
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--no-cuda", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-interval", type=int, default=10, help="batches between log lines")
    p.add_argument("--fp16-pushpull", action="store_true", help="push_pull gradients as float16")
    p.add_argument("--data", choices=["digits", "synthetic"], default="digits")
    return p.parse_args(argv)


def datasets(kind):
    if kind == "digits":
        return digits_dataset("train"), digits_dataset("test")
    return (synthetic_dataset(1024, (1, 8, 8), 10, seed=0),
            synthetic_dataset(256, (1, 8, 8), 10, seed=1))


def metric_average(value, name):
    """Mean of a Python number over all ranks."""
    return bps.push_pull(torch.tensor(float(value)), average=True, name=name).item()


def main(argv=None):
    args = parse_args(argv)
    bps.init()
    torch.manual_seed(args.seed)
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(bps.local_rank() % torch.cuda.device_count())
    device = torch.device("cuda" if cuda else "cpu")
    train_set, test_set = datasets(args.data)
    # Each rank trains on its own shard of the data.
    train_sampler = DistributedSampler(train_set, num_replicas=bps.size(), rank=bps.rank())
    test_sampler = DistributedSampler(test_set, num_replicas=bps.size(), rank=bps.rank(), shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)

    model = get_model("digits_cnn").to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * bps.size(), momentum=args.momentum)
    compression = bps.Compression.fp16 if args.fp16_pushpull else bps.Compression.none
    optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(optimizer, root_rank=0)

    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch, (data, target) in enumerate(train_loader):
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            if batch % args.log_interval == 0 and bps.rank() == 0:
                print(f"Train Epoch: {epoch} [{batch * len(data)}/{len(train_sampler)}]\t"
                      f"Loss: {loss.item():.6f}", flush=True)
        model.eval()
        loss_sum, correct = 0.0, 0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                output = model(data)
                loss_sum += F.cross_entropy(output, target, reduction="sum").item()
                correct += (output.argmax(1) == target).sum().item()
        test_loss = metric_average(loss_sum / len(test_sampler), "avg_loss")
        accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
        if bps.rank() == 0:
            print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100 * accuracy:.2f}%\n",
                  flush=True)
    bps.shutdown()
    return accuracy


if __name__ == "__main__":
    main()
