"""``BpstrainTrainer``: Ray Train's data-parallel trainer on bpstrain, as ``HorovodTrainer``.

::

    from ray.train import ScalingConfig
    from bpstrain.ray import BpstrainConfig, BpstrainTrainer

    def train_loop_per_worker(config):
        import bpstrain.torch as bps          # the job is formed already: init() is a no-op
        ...

    trainer = BpstrainTrainer(train_loop_per_worker,
                              scaling_config=ScalingConfig(num_workers=4, use_gpu=True),
                              bpstrain_config=BpstrainConfig(num_servers=2))
    result = trainer.fit()

Ray Train places and starts the workers; the backend (:class:`BpstrainConfig`) then starts
the scheduler and ``num_servers`` servers as CPU-only actors — beside the workers (server
``j`` on worker ``j % n``'s node) or, with ``server_resources``, in a ``SPREAD`` placement
group of nodes that have them — gives every worker the DMLC_* environment (rank = Ray
Train's world rank) and calls ``bpstrain.engine.init()`` there. Ray Train's own failure
handling applies (``FailureConfig``): a lost worker fails the run, and a retry forms a new
bpstrain job.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import ray
from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.constants import is_v2_enabled
from ray.util.scheduling_strategies import (NodeAffinitySchedulingStrategy,
                                            PlacementGroupSchedulingStrategy)

from bpstrain.ray._actors import (RayExecutorError, RoleActor, job_env, kill_all, node_info,
                                  outcome, place, serve_roles, setup_worker, teardown_worker,
                                  worker_env)

if is_v2_enabled():
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
else:  # RAY_TRAIN_V2_ENABLED=0
    from ray.train.data_parallel_trainer import DataParallelTrainer

_TEARDOWN_S = 10.0


@dataclasses.dataclass
class BpstrainConfig(BackendConfig):
    """The bpstrain backend of Ray Train.

    Attributes:
        num_servers: summation servers (CPU-only actors), at least 1.
        cpus_per_server: CPUs each server reserves (beside the workers they must be free
            on the workers' nodes; 0 shares the workers' CPUs).
        server_resources: e.g. ``{"cpu_node": 1}``: servers go to nodes that have it.
        timeout_s: rendezvous limit (``BPSTRAIN_RENDEZVOUS_TIMEOUT``) and for starting.
        placement_group_timeout_s: how long to wait for the servers' placement group.
        env: extra environment for every role (``BPSTRAIN_*`` knobs).
        secret: the cluster secret; None = a fresh random one per run.
    """

    num_servers: int = 1
    cpus_per_server: float = 1
    server_resources: Optional[Dict[str, float]] = None
    timeout_s: float = 60.0
    placement_group_timeout_s: float = 100.0
    env: Optional[Dict[str, str]] = None
    secret: Optional[str] = None

    def __post_init__(self):
        if isinstance(self.num_servers, bool) or not isinstance(self.num_servers, int) \
                or self.num_servers < 1:
            from bpstrain.errors import ConfigError

            raise ConfigError("BpstrainConfig.num_servers must be an integer >= 1. "
                              f"Received: num_servers={self.num_servers!r}")

    @property
    def backend_cls(self):
        return _BpstrainBackend


class _BpstrainBackend(Backend):
    share_cuda_visible_devices: bool = False

    def __init__(self):
        self._actors: List[Any] = []
        self._groups: List[Any] = []
        self._roles: Dict[Any, str] = {}

    def on_start(self, worker_group, backend_config: BpstrainConfig):
        try:
            self._start(worker_group, backend_config)
        except BaseException:
            self._stop()
            raise

    def _start(self, worker_group, config: BpstrainConfig) -> None:
        began = time.monotonic()
        limit = float(config.timeout_s)
        nodes = worker_group.execute(node_info)  # world-rank order
        resources = {k: float(v) for k, v in (config.server_resources or {}).items()}
        if resources:
            bundle = {k: v for k, v in {"CPU": float(config.cpus_per_server), **resources}.items() if v}
            group = place([bundle] * config.num_servers, "SPREAD", "servers",
                          float(config.placement_group_timeout_s), self._groups)
            where = [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=j)
                     for j in range(config.num_servers)]
        else:
            where = [NodeAffinitySchedulingStrategy(nodes[j % len(nodes)]["node_id"], soft=False)
                     for j in range(config.num_servers)]
        role_cls = ray.remote(RoleActor)
        scheduler = role_cls.options(num_cpus=0, max_concurrency=2,
                                     scheduling_strategy=where[0]).remote()
        servers = [role_cls.options(num_cpus=config.cpus_per_server, resources=resources or None,
                                    max_concurrency=2, scheduling_strategy=s).remote()
                   for s in where]
        self._actors = [scheduler, *servers]
        try:
            scheduler_node, port, *server_nodes = ray.get(
                [scheduler.node.remote(), scheduler.free_port.remote(),
                 *[s.node.remote() for s in servers]], timeout=limit)
        except ray.exceptions.GetTimeoutError:
            raise RayExecutorError(
                f"the bpstrain scheduler and {config.num_servers} servers did not start within "
                f"{limit:g} s: beside the workers they need {config.cpus_per_server} free CPU "
                "each on the workers' nodes (ScalingConfig may take them all); set "
                "BpstrainConfig(cpus_per_server=0) or server_resources") from None
        common = job_env(scheduler_node, port, len(nodes), config.num_servers, config.secret,
                         limit, config.env or {})
        self._roles = serve_roles(scheduler, scheduler_node, servers, server_nodes, common)
        setups = [worker_group.execute_single_async(i, setup_worker, worker_env(common, i, node))
                  for i, node in enumerate(nodes)]
        ready, _ = ray.wait(setups, num_returns=len(setups), timeout=limit + 5.0)
        ended = ray.wait(list(self._roles), num_returns=len(self._roles), timeout=0)[0]
        if ended:
            raise RayExecutorError(f"the bpstrain {self._roles[ended[0]]} ended while the job "
                                   f"formed: {outcome(ended[0])}")
        if len(ready) < len(setups):
            raise RayExecutorError(f"the bpstrain job did not form within {limit + 5:g} s "
                                   "(BpstrainConfig.timeout_s)")
        ranks = ray.get(setups)
        if [tuple(r) for r in ranks] != [(i, len(nodes)) for i in range(len(nodes))]:
            raise RayExecutorError(f"workers joined with (rank, size) {ranks}; expected Ray "
                                   "Train's world ranks")
        self.start_seconds = time.monotonic() - began

    def on_shutdown(self, worker_group, backend_config: BpstrainConfig):
        try:
            refs = worker_group.execute_async(teardown_worker)
            ray.wait(refs, num_returns=len(refs), timeout=_TEARDOWN_S)
            if self._roles:  # they end by themselves once every worker has left
                ray.wait(list(self._roles), num_returns=len(self._roles), timeout=_TEARDOWN_S)
        finally:
            self._stop()

    def _stop(self) -> None:
        kill_all(self._actors, self._groups)
        self._actors, self._groups, self._roles = [], [], {}


class BpstrainTrainer(DataParallelTrainer):
    """Ray Train's data-parallel trainer with a bpstrain job under the workers.

    Args:
        train_loop_per_worker: runs on every worker (no argument, or ``train_loop_config``).
        train_loop_config: passed to ``train_loop_per_worker`` when it takes one.
        bpstrain_config: servers and timeouts (:class:`BpstrainConfig`); the default has
            one server. Replaces ``DataParallelTrainer``'s ``backend_config``.
        scaling_config, run_config, datasets, dataset_config, metadata,
        resume_from_checkpoint: as for Ray's ``DataParallelTrainer``.
    """

    def __init__(self, train_loop_per_worker: Callable, *,
                 train_loop_config: Optional[Dict] = None,
                 bpstrain_config: Optional[BpstrainConfig] = None,
                 scaling_config=None, run_config=None, datasets=None, dataset_config=None,
                 metadata: Optional[Dict[str, Any]] = None, resume_from_checkpoint=None):
        super().__init__(
            train_loop_per_worker=train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=bpstrain_config or BpstrainConfig(),
            scaling_config=scaling_config,
            dataset_config=dataset_config,
            run_config=run_config,
            datasets=datasets,
            resume_from_checkpoint=resume_from_checkpoint,
            metadata=metadata,
        )

    def fit(self):
        """Runs the training as ``DataParallelTrainer.fit`` and returns its ``Result``.

        Ray Train installs a SIGINT handler for the run (Ctrl-C aborts it gracefully) and
        leaves it installed afterwards, where a later Ctrl-C would start a fresh Ray
        instance to abort a controller long gone; the caller's handler is put back.
        """
        if threading.current_thread() is not threading.main_thread():
            return super().fit()
        saved = signal.getsignal(signal.SIGINT)
        try:
            return super().fit()
        finally:
            signal.signal(signal.SIGINT, saved)
