"""torchrun workers on a scheduler and a server started by hand, with BytePS's variables.

For what learns its ranks from torchrun's variables (the c10d backend's own rendezvous,
Hugging Face Accelerate): each worker script writes ``$RESULT_DIR/<rank>.json`` (a file
per rank: two ranks printing to one pipe can interleave their lines).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun_job(worker_script: Path, result_dir: Path, op_timeout: int, timeout: float):
    """Scheduler and server by role, then ``torchrun --nproc-per-node 2 worker_script``.

    Returns:
        (torchrun's CompletedProcess, the ranks' JSON results in rank order).
    """
    common = {k: v for k, v in os.environ.items()
              if not k.startswith(("DMLC_", "BYTEPS_", "ACCELERATE_"))}
    common.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", BPSTRAIN_OP_TIMEOUT=str(op_timeout),
                  DMLC_NUM_WORKER="1", BYTEPS_LOCAL_SIZE="2", DMLC_NUM_SERVER="1",
                  DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()))
    roles = [subprocess.Popen([sys.executable, "-m", "bpstrain.launch"], cwd=REPO,
                              env={**common, "DMLC_ROLE": role}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for role in ("scheduler", "server")]
    try:
        # The workers' layout comes from torchrun (LOCAL_WORLD_SIZE), not from BytePS's.
        workers = {k: v for k, v in common.items() if k not in ("BYTEPS_LOCAL_SIZE", "DMLC_NUM_WORKER")}
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(free_port()), str(worker_script)],
            cwd=REPO, env={**workers, "DMLC_ROLE": "worker", "RESULT_DIR": str(result_dir)},
            capture_output=True, text=True, timeout=timeout)
    finally:
        for p in roles:
            try:
                p.wait(timeout=30)  # they exit once the workers have left
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    results = [json.loads(f.read_text()) for f in sorted(Path(result_dir).glob("*.json"))]
    return proc, results
