"""Type stubs of bpstrain's C++ engine (core_ext/bindings/module.cc).

Errors surface as bpstrain.errors exceptions: BpsError, MismatchError, PeerError,
BpsTimeoutError, ShutdownError, ConfigError.
"""

import enum
from typing import Any, Dict, List, Sequence, Union

import numpy as np

# Anything exporting the buffer protocol; numpy arrays in practice.
Buffer = Union[np.ndarray, bytearray, memoryview]

def dtype_size(dtype: str) -> int: ...
def set_log_prefix(prefix: str) -> None: ...
def resolve_cpus(spec: str, local_rank: int = 0) -> List[int]:
    """CPU list a NUMA spec ("off", "auto", "node:N", "cpus:0-3,8") resolves to."""
def numa_node_count() -> int: ...
def sum_into(dst: Buffer, src: Buffer, dtype: str) -> None:
    """dst += src with the servers' kernels (fp16/bf16 through fp32)."""
def accumulate(acc: Buffer, src: Buffer, dtype: str) -> None:
    """acc (float32) += src (float16/bfloat16), a server's per-push step."""

class CompressedRounds:
    """The servers' compressed-round rule alone (bpstrain/_codec.py is its reference)."""
    def __init__(self) -> None: ...
    def round(self, key: int, version: int, pushes: Sequence[Buffer]) -> bytes:
        """The answer to one round of compressed pushes (rank order); the error-feedback
        residual of ``key`` carries to its next round. Raises MismatchError on bad blobs."""

class Op(enum.Enum):
    """What one operation does with the ranks' tensors (0, 1, 2 convert implicitly)."""

    SUM = 0
    AVERAGE = 1
    BROADCAST = 2

class Scheduler:
    def __init__(self, num_workers: int, num_servers: int, host: str = "0.0.0.0", port: int = 0,
                 rendezvous_timeout: float = 120.0, peer_timeout: float = 30.0,
                 secret: str = "") -> None: ...
    @property
    def port(self) -> int: ...
    def start(self) -> None: ...
    def wait(self, seconds: float) -> bool:
        """True once every worker said goodbye; raises the job's failure."""
    def stop(self) -> None: ...

class Server:
    def __init__(self, scheduler_host: str, scheduler_port: int, listen_host: str = "0.0.0.0",
                 advertise_host: str = "", server_id: int = -1, engine_threads: int = 2,
                 numa: str = "auto", rendezvous_timeout: float = 120.0, secret: str = "") -> None: ...
    @property
    def port(self) -> int: ...
    def start(self) -> None: ...
    def wait(self, seconds: float) -> bool: ...
    def stop(self) -> None: ...

class Worker:
    def __init__(self, scheduler_host: str, scheduler_port: int, rank_hint: int = -1,
                 local_rank: int = 0, local_size: int = 1, partition_bytes: int = 4194304,
                 credit_bytes: int = 0, connections_per_server: int = 1, priority: bool = True,
                 numa: str = "auto", rendezvous_timeout: float = 120.0, secret: str = "",
                 hierarchical: int = 2, socket_send_buffer: int = -1, advertise_host: str = "",
                 host_id: str = "", transport: str = "tcp", authenticate_bodies: bool = True,
                 aggregate: int = 0, consistency: str = "sync", staleness_lr: bool = False) -> None: ...
    def start(self) -> None: ...
    def wait_ready(self, seconds: float) -> bool: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def num_servers(self) -> int: ...
    def declare(self, name: str, dtype: str, shape: Sequence[int], device: str = "cpu",
                layout: str = "") -> None:
        """Declares ``name`` now; another dtype/shape/device/layout later declares it afresh."""
    def enqueue(self, name: str, dtype: str, shape: Sequence[int], input: Buffer, output: Buffer,
                op: Op, root: int = 0, priority: int = 0, participants: int = 0,
                device: str = "cpu", layout: str = "", partition_bytes: int = 0,
                pull_only: bool = False, param: int = 0, lr: float = 0.0,
                server_optimizer: str = "") -> int:
        """Returns a handle (>= 1); buffers must stay alive. ``device`` and ``layout`` are
        compared across ranks with the shape and dtype. ``pull_only``: k-of-n catch-up;
        ``param`` 1/2: init/update of server-held weights (comm.consistency ssp/async)."""
    def enqueue_at(self, name: str, dtype: str, shape: Sequence[int], input: int, output: int,
                   nbytes: int, op: Op, priority: int = 0, param: int = 0, lr: float = 0.0,
                   server_optimizer: str = "") -> int: ...
    def rounds_behind(self, name: str) -> int: ...
    def enqueue_sparse(self, name: str, row_width: int, data: Buffer, priority: int = 0) -> int:
        """Row-sparse push_pull: ``data`` is int64 ids (ascending) then float32 rows."""
    def take_sparse_result(self, handle: int) -> bytes: ...
    def enqueue_barrier(self) -> int: ...
    def poll(self, handle: int) -> bool: ...
    def wait(self, handle: int, seconds: float) -> bool: ...
    def describe(self, handle: int) -> str: ...
    def stats(self) -> Dict[str, float]:
        """bytes_pushed, bytes_pulled, partitions, late_partitions (k-of-n), weight_answers and
        max_staleness (server-held weights); link_bytes_per_s and link_rtt_s as measured at
        rendezvous (0 when not measured)."""
    def set_trace(self, on: bool) -> None: ...
    def drain_trace(self) -> List[Dict[str, Any]]: ...
    def shutdown(self) -> None: ...
