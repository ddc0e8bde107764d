"""``DMLC_ROLE=worker`` with ``BYTEPS_LOCAL_SIZE=L``: one host's L worker processes.

BytePS's ``bpslaunch`` starts one process per local GPU on each worker host;
this is the same for a multi-host job started by hand (or by SLURM/Kubernetes),
where the scheduler and servers run elsewhere.
"""

from __future__ import annotations

import queue
from typing import Mapping, Sequence

from bpstrain.launch._procs import DEFAULT_GRACE, Child, log, stop_children, supervise


def run_local_ranks(cmd: Sequence[str], environ: Mapping[str, str], worker_id: int,
                    local_size: int, grace: float = DEFAULT_GRACE) -> int:
    """Runs ``local_size`` copies of ``cmd`` with ``BYTEPS_LOCAL_RANK`` 0..L-1.

    Output is prefixed ``[worker R]`` with the global rank
    R = worker_id * local_size + local_rank. When one copy fails, the others
    are stopped.

    Args:
        cmd: Worker command line.
        environ: Environment passed through to every copy.
        worker_id: This host's index (``DMLC_WORKER_ID``).
        local_size: Processes on this host (``BYTEPS_LOCAL_SIZE``).
        grace: Seconds between SIGTERM and SIGKILL on teardown.

    Returns:
        0 when all copies exited 0, else the first failing copy's exit status.
    """
    events: queue.Queue = queue.Queue()
    children: list[Child] = []
    base = {**environ, "PYTHONUNBUFFERED": "1", "BYTEPS_LOCAL_SIZE": str(local_size)}
    try:
        for local_rank in range(local_size):
            env = {**base, "BYTEPS_LOCAL_RANK": str(local_rank)}
            rank = worker_id * local_size + local_rank
            children.append(Child(f"worker {rank}", cmd, env, events.put))
    except OSError as exc:
        log(f"could not start {cmd[0]}: {exc.strerror}. Received: cmd={list(cmd)}")
        stop_children(children, grace)
        return 127
    except BaseException:
        stop_children(children, grace)
        raise
    return supervise(children, [], events, grace)
