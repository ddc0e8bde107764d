"""``python -m bpstrain.bench``: command line of the benchmarks.

Examples::

    python -m bpstrain.bench                       # loopback: 64M push_pull vs gloo, 4K latency
    python -m bpstrain.bench loopback --size 16M --iters 5
    python -m bpstrain.bench cluster --workers 2 4 --servers 1 2 4 \
        --sizes 4M 64M 256M --rate-mbit 800     # emulated hosts, needs root
    python -m bpstrain.bench cluster --workers 2 --servers 2 --sizes 64M \
        --partition-bytes 1M 4M 16M             # partition-size sweep
    python -m bpstrain.bench cluster --workers 4 --servers 0 1 2 4 --mixed   # mixed mode
    python -m bpstrain.bench hierarchical --size 64M   # flat vs hierarchical, 2x2 workers
    python -m bpstrain.bench scaling --workers 1 2 4 --sizes 4M 64M   # time vs n and size
    python -m bpstrain.bench overhead              # per-op cost: raw binding, engine, torch
    python -m bpstrain.bench fuzz                  # attacks a live job; checks it held
    python -m bpstrain.bench control-plane         # 16-1024 simulated workers: form, barrier
    python -m bpstrain.bench compression --rate-mbit 100 800   # compressors vs DDP hooks (root)
    python -m bpstrain.bench stragglers --scenarios none transient   # sync vs k-of-n (root)
    python -m bpstrain.bench sparse                                  # sparse embeddings (root)
    python -m bpstrain.bench compression --loopback --hosts 2 --servers 1 --iters 1 \
        --model digits_mlp --systems none onebit ddp-fp16 --acc-systems none topk \
        --tta-systems onebit --acc-steps 4 --tta-steps 4 --kernel-mbytes 1   # smoke, no root

Progress goes to stderr; the table is printed last on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

from bpstrain.bench import (_jobs, cluster, compression, control_plane, emulated, fuzz, hierarchical,
                            loopback, overhead, scaling, sparse, stragglers)
from bpstrain.bench.bounds import parse_size
from bpstrain.bench.table import format_table

# Benchmarks with their own module: add_arguments() and run_args().
_MODULES = {"hierarchical": hierarchical, "scaling": scaling, "overhead": overhead, "fuzz": fuzz,
            "control-plane": control_plane, "compression": compression, "stragglers": stragglers,
            "sparse": sparse}
_HELP = {"hierarchical": "flat vs hierarchical push_pull, hosts x local ranks (root)",
         "scaling": "bpstrain time vs workers and size on emulated hosts (root)",
         "overhead": "per-op cost of bpstrain.engine and bpstrain.torch over the raw binding",
         "fuzz": "attacks a live job on loopback; checks sums, crashes, fds, threads and RSS",
         "control-plane": "form, barrier, shutdown and scheduler memory of 16-1024 simulated workers",
         "compression": "gradient compressors vs DDP's hooks: step time, wire bytes, accuracy, "
                        "GB/s (root; --loopback none)",
         "stragglers": "synchronous vs k-of-n training with injected stragglers (root; --loopback none)",
         "sparse": "row-sparse embeddings vs bpstrain dense and DDP-gloo sparse: step, wire bytes (root)"}
_ON_LOOPBACK = ("loopback", "overhead", "fuzz", "control-plane")  # need no emulated hosts (no root)


def _partition(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else parse_size(text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (subcommands ``loopback``, the default, ``cluster``, and
    the modules' ``hierarchical``, ``scaling`` and ``overhead``)."""
    parser = argparse.ArgumentParser(
        prog="python -m bpstrain.bench",
        description="bpstrain push_pull vs torch.distributed gloo all_reduce.")
    sub = parser.add_subparsers(dest="command")

    lo = sub.add_parser("loopback", help="all processes on this machine (default)")
    lo.add_argument("--size", type=parse_size, default=64 << 20, help="tensor bytes (64M)")
    lo.add_argument("--workers", type=int, default=2)
    lo.add_argument("--servers", type=int, default=2)
    lo.add_argument("--iters", type=int, default=10)
    lo.add_argument("--warmup", type=int, default=2)
    lo.add_argument("--latency-size", type=parse_size, default=4 << 10)
    lo.add_argument("--latency-iters", type=int, default=200)
    lo.add_argument("--partition-bytes", type=parse_size, default=None)
    lo.add_argument("--timeout", type=float, default=300.0, help="seconds per job")

    cl = sub.add_parser("cluster", help="emulated hosts with capped links (root)")
    cl.add_argument("--workers", type=int, nargs="+", default=[2])
    cl.add_argument("--servers", type=int, nargs="+", default=[2])
    cl.add_argument("--sizes", type=parse_size, nargs="+", default=[4 << 20, 64 << 20])
    cl.add_argument("--rate-mbit", type=float, default=800.0,
                    help="per-host upload and download cap, Mbit/s")
    cl.add_argument("--partition-bytes", type=_partition, nargs="+", default=[None],
                    help="one value, or several for a partition-size sweep; 'auto' (the "
                    "default) lets the engine choose")
    cl.add_argument("--iters", type=int, default=5)
    cl.add_argument("--warmup", type=int, default=1)
    cl.add_argument("--scheduler", choices=["own", "host0"], default="own",
                    help="scheduler on its own host or on worker host 0")
    cl.add_argument("--latency-ms", type=float, default=20.0, help="tbf queue latency")
    cl.add_argument("--transports", nargs="+", default=["tcp"],
                    help="run the bpstrain jobs over each comm.transport (tcp, ucx, "
                    "ucx:<UCX_TLS>), same hosts, same run")
    cl.add_argument("--mixed", action="store_true",
                    help="also a server on every worker host (BytePS's mixed mode); "
                    "--servers then counts dedicated server hosts, 0 allowed")

    extra = [sub.add_parser(name, help=_HELP[name]) for name in _MODULES]
    for p, module in zip(extra, _MODULES.values()):
        module.add_arguments(p)

    for p in (lo, cl):
        p.add_argument("--no-gloo", dest="gloo", action="store_false",
                       help="skip the gloo baseline")
    for p in (cl, *(e for e, name in zip(extra, _MODULES) if name not in _ON_LOOPBACK)):
        p.add_argument("--cleanup-stale", action="store_true",
                       help="first delete namespaces left by crashed runs")
    for p in (lo, cl, *extra):
        p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the chosen benchmark and prints its table; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("loopback", "cluster", *_MODULES, "-h", "--help"):
        argv.insert(0, "loopback")
    args = build_parser().parse_args(argv)
    try:
        needs_root = getattr(_MODULES.get(args.command), "needs_root", lambda _: True)
        if args.command not in _ON_LOOPBACK and needs_root(args):
            ok, reason = emulated.available()
            if not ok:
                print(f"bpstrain.bench {args.command}: {reason}.", file=sys.stderr)
                return 2
            if args.cleanup_stale:
                emulated.cleanup_stale()
        if args.command in _MODULES:
            title, text, records = _MODULES[args.command].run_args(args)
        elif args.command == "cluster":
            rows = cluster.run(cluster.ClusterPlan(
                workers=args.workers, servers=args.servers, sizes=args.sizes,
                rate_mbit=args.rate_mbit, partitions=args.partition_bytes,
                iters=args.iters, warmup=args.warmup, scheduler=args.scheduler,
                gloo=args.gloo, latency_ms=args.latency_ms, mixed=args.mixed,
                transports=args.transports))
            title = (f"emulated cluster, {args.rate_mbit:g} Mbit/s per host "
                     "(n workers, k servers; vs gloo = gloo time / time)")
            text, records = format_table(rows), [r.as_dict() for r in rows]
        else:
            rows = loopback.run(loopback.LoopbackPlan(
                size=args.size, workers=args.workers, servers=args.servers,
                iters=args.iters, warmup=args.warmup, latency_size=args.latency_size,
                latency_iters=args.latency_iters, partition_bytes=args.partition_bytes,
                gloo=args.gloo, timeout_s=args.timeout))
            title = "loopback (vs gloo = gloo time / time; >1 means faster than gloo)"
            text, records = format_table(rows), [r.as_dict() for r in rows]
    except (_jobs.BenchError, ValueError) as exc:
        print(f"bpstrain.bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bpstrain.bench: interrupted; processes and namespaces were removed.",
              file=sys.stderr)
        return 130
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(records, handle, indent=2)
    print(title)
    print(text)
    return 0
