"""One worker of the faults benchmark (:mod:`bpstrain.bench.faults`): a digits CNN trained
for ``--steps`` synchronous steps while the benchmark kills, stops and cuts off workers.

bpstrain (``comm.fault_tolerance``; BytePS's ``DMLC_*`` variables, scheduler and servers
running): the state is a :class:`bpstrain.torch.elastic.TorchState` committed after every
step, so a restarted worker rejoins at the next step and nothing is rolled back::

    BPSTRAIN_FAULT_TOLERANCE=1 python -m bpstrain.bench._faults_worker --system bpstrain --steps 2000

torchrun (``torchrun --max-restarts``, gloo): DDP from the last checkpoint, written by
rank 0 every ``--checkpoint-every`` steps; a failure restarts every worker from it::

    torchrun ... -m bpstrain.bench._faults_worker --system torchrun --checkpoint ckpt.pt

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

BATCH = 32  # per worker and step


def _batch(train, rank: int, step: int):
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    idx = torch.randint(len(train), (BATCH,), generator=g)
    return train.tensors[0][idx], train.tensors[1][idx]


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


def _model():
    from bpstrain.models import get_model

    torch.manual_seed(0)
    return get_model("digits_cnn")


def run_bpstrain(args, train, test) -> dict:
    import bpstrain.torch as bps
    from bpstrain import engine

    bps.init()
    me = engine.membership()["rendezvous_rank"]
    progress = _Progress(args.progress, "bpstrain", me)
    engine.on_membership_change(lambda m: progress.note(f"membership size={m['size']} departed={m['departed']}"))
    model = _model()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = bps.elastic.TorchState(model, opt, step=0)
    state.sync()
    progress.note(f"start step={state.step} restart={os.environ.get('BPSTRAIN_RESTART', '0')}")
    while state.step < args.steps:
        x, y = _batch(train, me, state.step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        state.step += 1
        progress.step(state.step, bps.size())
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
    model = _model()
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
        x, y = _batch(train, rank, step)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=("bpstrain", "torchrun"), required=True)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--progress", required=True, help="directory of the per-step lines")
    p.add_argument("--checkpoint", default="", help="torchrun: the checkpoint file")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--timeout", type=float, default=5.0, help="torchrun: gloo's timeout (s)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from bpstrain.models import digits_dataset

    train, test = digits_dataset("train"), digits_dataset("test")
    result = (run_bpstrain if args.system == "bpstrain" else run_torchrun)(args, train, test)
    if result["rank"] == 0:
        print("FAULTS_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
