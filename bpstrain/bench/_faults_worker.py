"""One worker of the faults benchmark (:mod:`bpstrain.bench.faults`): a digits CNN (or, with
``--model vgg16``, VGG-16 on the digits upscaled to 3x32x32) trained for ``--steps``
synchronous steps of ``--batch`` samples while the benchmark kills, stops and cuts off
workers.

bpstrain (``comm.fault_tolerance``; BytePS's ``DMLC_*`` variables, scheduler and servers
running): the state is a :class:`bpstrain.torch.elastic.TorchState` committed after every
step, so a restarted worker rejoins at the next step and nothing is rolled back::

    BPSTRAIN_FAULT_TOLERANCE=1 python -m bpstrain.bench._faults_worker --system bpstrain --steps 2000

torchrun (``torchrun --max-restarts``, gloo): DDP from the last checkpoint, written by
rank 0 every ``--checkpoint-every`` steps; a failure restarts every worker from it::

    torchrun ... -m bpstrain.bench._faults_worker --system torchrun --checkpoint ckpt.pt

torchft (``pip install torchft==0.2.0``; a lighthouse running, its address in
``TORCHFT_LIGHTHOUSE``): one replica group per worker, ``torchft.Optimizer``
and the manager's allreduce over its ``ProcessGroupGloo``; a restarted group recovers the
others' state from a peer at its first quorum (torchft's per-step recovery)::

    python -m bpstrain.bench._faults_worker --system torchft --rank 1 --host 10.0.0.2

Every process appends one line per step to ``--progress DIR/<system>-<rank>-<pid>``:
``step wall_time workers``; the lowest rank prints the test accuracy at the end as a
``FAULTS_RESULT`` JSON line.
"""

from __future__ import annotations

import time

_STARTED = time.time()  # before torch's import: when the process was launched

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

def _batch(train, rank: int, step: int, size: int):
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    idx = torch.randint(len(train), (size,), generator=g)
    return train.tensors[0][idx], train.tensors[1][idx]


def _as_images(data):
    """The 8x8 digits as VGG-16's input: 3 x 32 x 32 (VGG's five poolings need >= 32)."""
    from torch.utils.data import TensorDataset

    x = F.interpolate(data.tensors[0], size=(32, 32), mode="bilinear", align_corners=False)
    return TensorDataset(x.expand(-1, 3, -1, -1).contiguous(), data.tensors[1])


def _accuracy(model, test) -> float:
    with torch.no_grad():
        return float((model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean())


class _Progress:
    """The per-step lines the benchmark reads (a file per process: restarts add files)."""

    def __init__(self, directory: str, system: str, rank):
        os.makedirs(directory, exist_ok=True)
        self._f = open(os.path.join(directory, f"{system}-{rank}-{os.getpid()}"), "a", buffering=1)

    def step(self, step: int, workers: int) -> None:
        self._f.write(f"{step} {time.time():.4f} {workers}\n")

    def note(self, what: str, when: float = 0.0) -> None:
        self._f.write(f"# {when or time.time():.4f} {what}\n")


def _model(name: str):
    from bpstrain.models import get_model

    torch.manual_seed(0)
    return get_model(name, num_classes=10) if name == "vgg16" else get_model(name)


def run_bpstrain(args, train, test) -> dict:
    import bpstrain.torch as bps
    from bpstrain import engine

    bps.init()
    me = engine.membership()["rendezvous_rank"]
    progress = _Progress(args.progress, "bpstrain", me)
    engine.on_membership_change(lambda m: progress.note(f"membership size={m['size']} departed={m['departed']}"))
    model = _model(args.model)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = bps.elastic.TorchState(model, opt, step=0)
    state.sync()
    progress.note(f"start step={state.step} restart={os.environ.get('BPSTRAIN_RESTART', '0')}")
    lost = []
    while state.step < args.steps:
        x, y = _batch(train, me, state.step, args.batch)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        state.step += 1
        progress.step(state.step, bps.size())
        if engine.membership()["lost_servers"] != lost:  # a server was lost (its partitions moved)
            lost = engine.membership()["lost_servers"]
            progress.note(f"servers lost={lost}")
        state.commit()
    return {"rank": bps.rank(), "accuracy": _accuracy(model, test), "steps": state.step}


def run_torchrun(args, train, test) -> dict:
    import torch.distributed as dist

    # The agent (re)started this process: it noticed a failure (each try of a restart,
    # also one that fails to connect, leaves a note of its own before the rendezvous).
    _Progress(args.progress, "torchrun", "launch").note("launched", _STARTED)
    # A long timeout to connect (4 workers importing torch on a loaded host take their
    # time; a short one makes restarts fail and start again, for minutes), the short one
    # for the training's collectives: what detects a hung or cut-off peer.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(timeout=datetime.timedelta(seconds=args.timeout))
    progress = _Progress(args.progress, "torchrun", rank)
    model = _model(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = 0
    if os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        step = saved["step"]
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    progress.note(f"start step={step} restart={os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    while step < args.steps:
        x, y = _batch(train, rank, step, args.batch)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        step += 1
        progress.step(step, size)
        if rank == 0 and step % args.checkpoint_every == 0:
            tmp = args.checkpoint + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, args.checkpoint)  # never half a checkpoint
    dist.destroy_process_group()
    return {"rank": rank, "accuracy": _accuracy(model, test), "steps": step}


def run_torchft(args, train, test) -> dict:
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    progress = _Progress(args.progress, "torchft", args.rank)
    model = _model(args.model)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # The replica group's own store (one process per group here): torchft expects the one
    # torchrun would start.
    store = TCPStore(args.host, 0, 1, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=args.timeout))
    manager = Manager(
        pg=pg,
        # The state goes to a recovering group over the process group: torchft's HTTP
        # transport advertises the machine's hostname, which the emulated hosts share.
        checkpoint_transport=PGTransport(pg, timeout=datetime.timedelta(seconds=max(30.0, args.timeout)),
                                         device=torch.device("cpu")),
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optimizer"])),
        state_dict=lambda: {"model": model.state_dict(), "optimizer": inner.state_dict()},
        min_replica_size=1, timeout=datetime.timedelta(seconds=max(30.0, args.timeout)),
        rank=0, world_size=1, store_addr=args.host, store_port=store.port, hostname=args.host,
        replica_id=f"faults_{args.rank}", lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"])
    # The gradients as one flat allreduce, what DDP's bucket does for a model this small.
    # (torchft.DistributedDataParallel 0.2.0 fails an assertion in its comm hook when an
    # allreduce fails with a later bucket pending, ending the process instead of the step.)
    params = list(model.parameters())
    opt = Optimizer(manager, inner)
    progress.note(f"start step={manager.current_step()} restart={os.environ.get('BPSTRAIN_RESTART', '0')}")
    workers = 0
    while manager.current_step() < args.steps:
        step = manager.current_step()
        x, y = _batch(train, args.rank, step, args.batch)
        opt.zero_grad()  # starts the quorum
        F.cross_entropy(model(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        manager.allreduce(flat).wait()  # averaged over the groups in the quorum
        torch.nn.utils.vector_to_parameters(flat, [p.grad for p in params])
        opt.step()  # commits only when every group's allreduce succeeded
        if manager.current_step() == step:
            progress.note(f"uncommitted step={step}")  # computed again: a step lost
            continue
        if manager.num_participants() != workers:
            workers = manager.num_participants()
            progress.note(f"membership size={workers}")
        progress.step(manager.current_step(), workers)
    return {"rank": args.rank, "accuracy": _accuracy(model, test), "steps": manager.current_step()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=("bpstrain", "torchrun", "torchft"), required=True)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--progress", required=True, help="directory of the per-step lines")
    p.add_argument("--checkpoint", default="", help="torchrun: the checkpoint file")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--timeout", type=float, default=5.0, help="torchrun, torchft: gloo's timeout (s)")
    p.add_argument("--rank", type=int, default=0, help="torchft: this replica group's number")
    p.add_argument("--host", default="127.0.0.1", help="torchft: this host's address")
    p.add_argument("--model", default="digits_cnn", choices=("digits_cnn", "vgg16"))
    p.add_argument("--batch", type=int, default=32, help="samples per worker and step")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from bpstrain.models import digits_dataset

    train, test = digits_dataset("train"), digits_dataset("test")
    if args.model == "vgg16":
        train, test = _as_images(train), _as_images(test)
    result = {"bpstrain": run_bpstrain, "torchrun": run_torchrun, "torchft": run_torchft}[args.system](
        args, train, test)
    if result["rank"] == 0:
        print("FAULTS_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
