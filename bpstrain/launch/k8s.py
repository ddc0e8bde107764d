"""``python -m bpstrain.launch k8s``: Kubernetes manifests for one bpstrain job.

``python -m bpstrain.launch k8s --workers N --servers K --image IMAGE [--local-size L]
[--gpus-per-worker G] [--namespace NS] -- CMD ...`` prints (YAML, several documents) core
objects only, so any cluster applies them with ``kubectl apply -f`` and no operator:

* a Secret holding a fresh random ``BPSTRAIN_SECRET`` (or, with ``--secret-name``, a
  reference to one you made; key ``secret``);
* a headless Service ``NAME-scheduler`` in front of the scheduler; every role gets its
  DNS name in ``DMLC_PS_ROOT_URI`` and waits, in an init container, until it resolves
  (the engine resolves the address once);
* three Indexed Jobs: ``NAME-scheduler`` (1 pod), ``NAME-servers`` (K pods,
  ``DMLC_SERVER_ID`` = completion index) and ``NAME-workers`` (N/L pods of L processes,
  ``DMLC_WORKER_ID`` = completion index, ``DMLC_NUM_WORKER`` = N/L, as the local launcher
  counts). Jobs rather than StatefulSets: every role exits once the workers are done, so a
  Job completes where a StatefulSet would restart it.

Fail-fast, not elastic: ``restartPolicy: Never`` and ``backoffLimit: 0``, so a pod that
dies fails its Job, and the other roles fail with it (the scheduler notices the lost peer).

Servers and workers advertise their pod IP (``DMLC_NODE_HOST`` from ``status.podIP``);
the scheduler listens on every interface (``BPSTRAIN_LISTEN_HOST=0.0.0.0``), since the
Service's name is not an address of its own.
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys
from decimal import Decimal
from typing import Any, Sequence

from bpstrain.launch._cli import PROG as _LAUNCH_PROG
from bpstrain.launch._cli import USAGE_EXIT, UsageError, _int_flag, _seconds

PROG = f"{_LAUNCH_PROG} k8s"
SECRET_KEY = "secret"
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LONGEST_SUFFIX = len("-scheduler")
_QUANTITY = re.compile(r"^(?P<num>[0-9]+(\.[0-9]*)?|\.[0-9]+)"
                       r"(?P<unit>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|)$")
_SCHEDULER_RESOURCES = {"cpu": "250m", "memory": "256Mi"}
# Run by an init container of every server and worker: the headless Service's name only
# resolves once the scheduler pod has an IP, and the engine resolves it only once.
WAIT_FOR_SCHEDULER = """\
import os, socket, sys, time
host, limit = os.environ["DMLC_PS_ROOT_URI"], os.environ["BPSTRAIN_RENDEZVOUS_TIMEOUT"]
deadline = time.monotonic() + float(limit)
while True:
    try:
        socket.getaddrinfo(host, None, socket.AF_INET)
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"the scheduler's Service {host} did not resolve within {limit} s "
                     "(BPSTRAIN_RENDEZVOUS_TIMEOUT): is the scheduler pod running?")
        time.sleep(1)
"""


def _name(flag: str, pattern: re.Pattern, max_len: int, what: str):
    def parse(text: str) -> str:
        if len(text) > max_len or not pattern.match(text):
            raise argparse.ArgumentTypeError(
                f"expected {what} of at most {max_len} characters. Received: {flag}={text!r}")
        return text
    return parse


def _quantity(flag: str):
    def parse(text: str) -> str:
        if not _QUANTITY.match(text):
            raise argparse.ArgumentTypeError(
                "expected a Kubernetes quantity such as 2, 500m, 4Gi. "
                f"Received: {flag}={text!r}")
        return text
    return parse


def _times(quantity: str, factor: int) -> str:
    """``quantity`` × ``factor``, in the same unit (e.g. ``1.5Gi`` × 2 = ``3Gi``)."""
    match = _QUANTITY.match(quantity)
    assert match, quantity
    return format((Decimal(match["num"]) * factor).normalize(), "f") + match["unit"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, usage=f"{PROG} --workers N [--servers K] --image IMAGE [--local-size L] "
        "[--gpus-per-worker G] [--namespace NS] [--name NAME] [--secret-name SECRET] "
        "-- CMD ...",
        description="Print Kubernetes manifests (a Secret, a headless Service and three "
        "Indexed Jobs; core objects only) that run a bpstrain job: apply them with "
        "`kubectl apply -f`. Fail-fast: any pod that dies fails the job.")
    parser.add_argument("--workers", type=_int_flag("--workers", 1), metavar="N", required=True,
                        help="worker processes in all: N/L pods of L processes "
                        "(DMLC_NUM_WORKER=N/L, BYTEPS_LOCAL_SIZE=L)")
    parser.add_argument("--servers", type=_int_flag("--servers", 1), metavar="K", default=1,
                        help="summation servers, one CPU-only pod each (default 1)")
    parser.add_argument("--local-size", type=_int_flag("--local-size", 1), metavar="L",
                        default=1, help="worker processes per pod; must divide --workers "
                        "(default 1)")
    parser.add_argument("--image", required=True, metavar="IMAGE",
                        help="container image with bpstrain and the training script")
    parser.add_argument("--namespace", type=_name("--namespace", _DNS_1123_LABEL, 63,
                                                  "a DNS label (a-z, 0-9, '-')"),
                        metavar="NS", help="namespace of every object (default: kubectl's)")
    parser.add_argument("--name", default="bpstrain", metavar="NAME",
                        type=_name("--name", _DNS_LABEL, 63 - _LONGEST_SUFFIX,
                                   "a DNS label starting with a letter (a-z, 0-9, '-')"),
                        help="prefix of the objects' names (default bpstrain)")
    parser.add_argument("--gpus-per-worker", type=_int_flag("--gpus-per-worker", 0),
                        metavar="G", default=0,
                        help="nvidia.com/gpu per worker process (a pod asks for G*L)")
    parser.add_argument("--cpu-per-worker", type=_quantity("--cpu-per-worker"), default="1",
                        metavar="CPU", help="CPU request per worker process (default 1)")
    parser.add_argument("--memory-per-worker", type=_quantity("--memory-per-worker"),
                        default="4Gi", metavar="MEM",
                        help="memory request per worker process (default 4Gi)")
    parser.add_argument("--cpu-per-server", type=_quantity("--cpu-per-server"), default="2",
                        metavar="CPU", help="CPU request per server pod (default 2)")
    parser.add_argument("--memory-per-server", type=_quantity("--memory-per-server"),
                        default="2Gi", metavar="MEM",
                        help="memory request per server pod (default 2Gi)")
    parser.add_argument("--secret-name", metavar="SECRET",
                        type=_name("--secret-name", _DNS_1123_LABEL, 253,
                                   "a Secret name (a-z, 0-9, '-')"),
                        help=f"use this existing Secret's key {SECRET_KEY!r} as BPSTRAIN_SECRET "
                        "instead of generating one into the output")
    parser.add_argument("--port", type=_int_flag("--port", 1, 65535), default=9000,
                        metavar="PORT", help="scheduler port (default 9000)")
    parser.add_argument("--rendezvous-timeout", type=_seconds("--rendezvous-timeout"),
                        default=600.0, metavar="SECONDS",
                        help="seconds for every pod to start and join (default 600: image "
                        "pulls and scheduling take time)")
    parser.add_argument("--python", default="python", metavar="EXE",
                        help="Python executable in the image (default python)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD",
                        help="worker command, after --")
    return parser


def _labels(name: str, component: str) -> dict:
    return {"app.kubernetes.io/name": "bpstrain", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}


def _metadata(args: argparse.Namespace, name: str, component: str) -> dict:
    meta: dict[str, Any] = {"name": name, "labels": _labels(args.name, component)}
    if args.namespace:
        meta["namespace"] = args.namespace
    return meta


def _root_uri(args: argparse.Namespace) -> str:
    service = f"{args.name}-scheduler"
    return f"{service}.{args.namespace}.svc" if args.namespace else service


def _field(path: str) -> dict:
    return {"fieldRef": {"fieldPath": path}}


_INDEX = _field("metadata.annotations['batch.kubernetes.io/job-completion-index']")


def _env(args: argparse.Namespace, role: str) -> list:
    secret_name = args.secret_name or f"{args.name}-secret"
    env: list[dict[str, Any]] = [
        {"name": "DMLC_ROLE", "value": role},
        {"name": "DMLC_PS_ROOT_URI", "value": _root_uri(args)},
        {"name": "DMLC_PS_ROOT_PORT", "value": str(args.port)},
        {"name": "DMLC_NUM_WORKER", "value": str(args.workers // args.local_size)},
        {"name": "DMLC_NUM_SERVER", "value": str(args.servers)},
        {"name": "BYTEPS_LOCAL_SIZE", "value": str(args.local_size)},
        {"name": "BPSTRAIN_RENDEZVOUS_TIMEOUT", "value": format(args.rendezvous_timeout, "g")},
        {"name": "BPSTRAIN_SECRET", "valueFrom": {"secretKeyRef": {
            "name": secret_name, "key": SECRET_KEY}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if role == "scheduler":
        env.append({"name": "BPSTRAIN_LISTEN_HOST", "value": "0.0.0.0"})
    else:
        env.append({"name": "DMLC_NODE_HOST", "valueFrom": _field("status.podIP")})
        index_var = "DMLC_SERVER_ID" if role == "server" else "DMLC_WORKER_ID"
        env.append({"name": index_var, "valueFrom": _INDEX})
    return env


def _resources(args: argparse.Namespace, role: str) -> dict:
    if role == "scheduler":
        return {"requests": dict(_SCHEDULER_RESOURCES)}
    if role == "server":
        return {"requests": {"cpu": args.cpu_per_server, "memory": args.memory_per_server}}
    requests = {"cpu": _times(args.cpu_per_worker, args.local_size),
                "memory": _times(args.memory_per_worker, args.local_size)}
    if not args.gpus_per_worker:
        return {"requests": requests}
    gpus = str(args.gpus_per_worker * args.local_size)
    return {"requests": {**requests, "nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}}


def _job(args: argparse.Namespace, role: str, pods: int, cmd: list) -> dict:
    component = role if role == "scheduler" else role + "s"
    name = f"{args.name}-{component}"
    env = _env(args, role)
    container: dict[str, Any] = {
        "name": role, "image": args.image, "command": [args.python, "-m", "bpstrain.launch"]}
    if role == "worker":
        container["args"] = ["--", *cmd]
    container.update(env=env, resources=_resources(args, role))
    pod: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if role == "scheduler":
        container["ports"] = [{"name": "scheduler", "containerPort": args.port}]
    else:
        pod["initContainers"] = [{
            "name": "wait-for-scheduler", "image": args.image,
            "command": [args.python, "-c", WAIT_FOR_SCHEDULER],
            "env": [dict(e) for e in env if e["name"] in ("DMLC_PS_ROOT_URI",
                                                          "BPSTRAIN_RENDEZVOUS_TIMEOUT")],
            "resources": {"requests": dict(_SCHEDULER_RESOURCES)}}]
    if role == "worker" and args.local_size > 1:
        # The local ranks share tensors through /dev/shm; a container's default is 64 MiB.
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        pod["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(args, name, component),
        "spec": {
            "completionMode": "Indexed", "completions": pods, "parallelism": pods,
            "backoffLimit": 0,  # fail-fast: one pod failure fails the Job (not elastic)
            "template": {"metadata": {"labels": _labels(args.name, component)},
                         "spec": pod}}}


def manifests(args: argparse.Namespace, cmd: Sequence[str]) -> list:
    """The objects of one job, in the order ``kubectl apply`` should create them."""
    docs = []
    if not args.secret_name:
        docs.append({"apiVersion": "v1", "kind": "Secret",
                     "metadata": _metadata(args, f"{args.name}-secret", "secret"),
                     "type": "Opaque", "stringData": {SECRET_KEY: secrets.token_hex(32)}})
    docs.append({
        "apiVersion": "v1", "kind": "Service",
        "metadata": _metadata(args, f"{args.name}-scheduler", "scheduler"),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": _labels(args.name, "scheduler"),
                 "ports": [{"name": "scheduler", "port": args.port,
                            "targetPort": args.port}]}})
    docs.append(_job(args, "scheduler", 1, []))
    docs.append(_job(args, "server", args.servers, []))
    docs.append(_job(args, "worker", args.workers // args.local_size, list(cmd)))
    return docs


def _check(args: argparse.Namespace, cmd: Sequence[str]) -> None:
    if not cmd:
        raise UsageError("no worker command given; put it after `--`, e.g. "
                         f"`{PROG} --workers 2 --image IMAGE -- python train.py`. "
                         "Received: CMD=[]")
    if args.workers % args.local_size:
        raise UsageError(
            "--workers must be a multiple of --local-size (each worker pod runs "
            f"--local-size processes). Received: --workers={args.workers}, "
            f"--local-size={args.local_size}")
    if not args.image.strip() or any(c.isspace() for c in args.image):
        raise UsageError(f"--image must be an image reference without spaces. "
                         f"Received: --image={args.image!r}")


def _dumper():
    import yaml

    class Dumper(yaml.SafeDumper):
        """Multi-line strings (the init container's script) as readable ``|`` blocks."""

    def text(dumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                       style="|" if "\n" in value else None)
    Dumper.add_representer(str, text)
    return Dumper


def main(argv: Sequence[str], out=None) -> int:
    """Prints the manifests for ``argv`` (the arguments after ``k8s``) to ``out``.

    Returns:
        0, or 2 (with a message on stderr) for bad arguments.
    """
    import yaml

    parser = _parser()
    args = parser.parse_args(list(argv))  # SystemExit(2) with a message on bad flags.
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else list(args.cmd)
    try:
        _check(args, cmd)
    except UsageError as exc:
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return USAGE_EXIT
    out = sys.stdout if out is None else out
    out.write(f"# bpstrain job {args.name!r}: kubectl apply -f FILE; "
              f"kubectl logs -f job/{args.name}-workers; kubectl delete -f FILE\n")
    if not args.secret_name:
        out.write("# This file holds the job's random BPSTRAIN_SECRET: keep it private.\n")
    yaml.dump_all(manifests(args, cmd), out, Dumper=_dumper(), sort_keys=False,
                  default_flow_style=False)
    return 0
