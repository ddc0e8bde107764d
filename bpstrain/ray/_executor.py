"""``RayExecutor``: a bpstrain job on a Ray cluster, in the shape of ``horovod.ray.RayExecutor``.

::

    import ray
    from bpstrain.ray import RayExecutor

    ray.init(address="auto")
    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=4, num_servers=2, cpus_per_worker=1)
    executor.start()                       # scheduler, servers, workers; init() on each
    sums = executor.run(train, args=(cfg,))  # one result per worker, in rank order
    executor.shutdown()                    # every actor ended, placement groups removed

Placement: the workers' bundles go in one placement group (``SPREAD`` by default, so
workers land on distinct nodes where the cluster allows). The servers go where
``server_resources`` asks (e.g. ``{"cpu_node": 1}``, a custom resource of CPU-only nodes),
one bundle each in a ``SPREAD`` group of their own; without it, server ``j`` shares the
bundle of worker ``j % num_workers`` (its CPUs are added to it), so the servers spread over
the workers' nodes and mixed mode balances the keys. The scheduler (no CPU) joins the
first server's bundle. Every role gets BytePS's environment: ``DMLC_PS_ROOT_URI`` = the
scheduler's node IP, ``DMLC_PS_ROOT_PORT`` = a port free there, ``DMLC_NODE_HOST`` = the
actor's node IP, ``BPSTRAIN_HOST_ID`` = its Ray node id (nodes of one machine share an
IP), one worker per host (``DMLC_NUM_WORKER`` = workers, ``BYTEPS_LOCAL_SIZE=1``, rank =
``DMLC_WORKER_ID``) and a fresh random ``BPSTRAIN_SECRET``.

Fail-fast, not elastic: a worker, server or scheduler actor that dies (or its node) makes
the running :meth:`RayExecutor.run` raise :class:`RayExecutorError` naming the rank or role,
its node and Ray's reason; call :meth:`RayExecutor.shutdown` and start again.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from bpstrain.errors import ConfigError
from bpstrain.ray._actors import (RayExecutorError, RoleActor, WorkerActor, describe, job_env,
                                  kill_all, place, serve_roles, worker_env)

_GRACE_S = 2.0  # after a first failure, how long to let the others report theirs
_TEARDOWN_S = 10.0


@dataclasses.dataclass
class RaySettings:
    """What :meth:`RayExecutor.create_settings` returns.

    Attributes:
        timeout_s: rendezvous limit (``BPSTRAIN_RENDEZVOUS_TIMEOUT``) and how long
            :meth:`RayExecutor.start` waits for the job to form.
        placement_group_timeout_s: how long to wait for the placement groups.
        env: extra environment for every role (e.g. ``{"BPSTRAIN_OP_TIMEOUT": "30"}``).
        secret: the cluster secret; None = a fresh random one per job.
    """

    timeout_s: float = 60.0
    placement_group_timeout_s: float = 100.0
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    secret: Optional[str] = None


def _positive(name: str, value: Any, minimum: float = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ConfigError(f"RayExecutor's {name} must be a number >= {minimum}. "
                          f"Received: {name}={value!r}")


class RayExecutor:
    """Runs a bpstrain job (scheduler, servers, workers) as Ray actors.

    Args:
        settings: from :meth:`create_settings`.
        num_workers: worker actors (ranks 0 … num_workers−1).
        num_servers: summation server actors (CPU only), at least 1.
        cpus_per_worker: CPUs each worker reserves.
        use_gpu: reserve ``gpus_per_worker`` GPUs (default 1) per worker.
        gpus_per_worker: GPUs per worker when ``use_gpu``.
        server_resources: extra resources each server's bundle requests, e.g.
            ``{"cpu_node": 1}`` to put servers on CPU nodes; None = on the workers' nodes.
        cpus_per_server: CPUs each server reserves.
        placement_strategy: the workers' placement group strategy (``SPREAD``,
            ``STRICT_SPREAD``, ``PACK``, ``STRICT_PACK``).
        executable_cls: optional class instantiated on every worker after ``init()``
            (with ``executable_args``/``executable_kwargs``); :meth:`execute` passes it.
    """

    def __init__(self, settings: Optional[RaySettings] = None, num_workers: int = 4,
                 num_servers: int = 2, cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[float] = None,
                 server_resources: Optional[Mapping[str, float]] = None,
                 cpus_per_server: float = 1, placement_strategy: str = "SPREAD",
                 executable_cls: Optional[type] = None, executable_args: Sequence = (),
                 executable_kwargs: Optional[Mapping[str, Any]] = None):
        _positive("num_workers", num_workers)
        _positive("num_servers", num_servers)
        _positive("cpus_per_worker", cpus_per_worker, 0)
        _positive("cpus_per_server", cpus_per_server, 0)
        if placement_strategy not in ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK"):
            raise ConfigError("RayExecutor's placement_strategy must be SPREAD, STRICT_SPREAD, "
                              f"PACK or STRICT_PACK. Received: {placement_strategy!r}")
        self.settings = settings or RaySettings()
        self.num_workers, self.num_servers = int(num_workers), int(num_servers)
        self.cpus_per_worker, self.cpus_per_server = cpus_per_worker, cpus_per_server
        self.gpus_per_worker = (1 if gpus_per_worker is None else gpus_per_worker) if use_gpu else 0
        self.server_resources = dict(server_resources or {})
        self.placement_strategy = placement_strategy
        self._executable = (executable_cls, tuple(executable_args), dict(executable_kwargs or {}))
        self.workers: List[Any] = []  # worker actor handles, in rank order
        self.servers: List[Any] = []
        self.scheduler: Any = None
        self.worker_nodes: List[dict] = []  # node_id / ip / pid of each worker, rank order
        self.server_nodes: List[dict] = []
        self.scheduler_node: Optional[dict] = None
        self.start_seconds: Optional[float] = None  # how long start() took
        self._groups: List[Any] = []
        self._roles: Dict[Any, str] = {}  # serve() ObjectRef -> "scheduler" / "server j"
        self._failed: Optional[str] = None

    @staticmethod
    def create_settings(timeout_s: float = 60.0, placement_group_timeout_s: float = 100.0,
                        env: Optional[Mapping[str, str]] = None,
                        secret: Optional[str] = None) -> RaySettings:
        """Settings for :class:`RayExecutor` (Horovod's ``create_settings``)."""
        _positive("timeout_s", timeout_s, 0.001)
        _positive("placement_group_timeout_s", placement_group_timeout_s, 0.001)
        return RaySettings(float(timeout_s), float(placement_group_timeout_s),
                           {str(k): str(v) for k, v in (env or {}).items()}, secret)

    # -- start ---------------------------------------------------------------------------

    def _bundles(self) -> Tuple[List[dict], Optional[List[dict]]]:
        workers = [{"CPU": float(self.cpus_per_worker)} for _ in range(self.num_workers)]
        for b in workers:
            if self.gpus_per_worker:
                b["GPU"] = float(self.gpus_per_worker)
        if not self.server_resources:
            for j in range(self.num_servers):
                workers[j % self.num_workers]["CPU"] += float(self.cpus_per_server)
            return [{k: v for k, v in b.items() if v} or {"CPU": 0.01} for b in workers], None
        server = {"CPU": float(self.cpus_per_server), **{k: float(v) for k, v in self.server_resources.items()}}
        return ([{k: v for k, v in b.items() if v} or {"CPU": 0.01} for b in workers],
                [{k: v for k, v in server.items() if v} for _ in range(self.num_servers)])

    def _place(self, bundles: List[dict], strategy: str, what: str):
        return place(bundles, strategy, what, self.settings.placement_group_timeout_s,
                     self._groups)

    def start(self) -> "RayExecutor":
        """Places and starts every actor and waits until the job has formed.

        Raises:
            RayExecutorError: placement or rendezvous failed (everything is cleaned up).
        """
        if self.workers:
            raise RuntimeError("RayExecutor already started; call shutdown() first")
        if not ray.is_initialized():
            ray.init()
        began = time.monotonic()
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise
        self.start_seconds = time.monotonic() - began
        return self

    def _start(self) -> None:
        worker_bundles, server_bundles = self._bundles()
        wgroup = self._place(worker_bundles, self.placement_strategy, "workers")
        sgroup = self._place(server_bundles, "SPREAD", "servers") if server_bundles else None

        def at(group, index):
            return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)

        role_cls = ray.remote(RoleActor)
        if sgroup is None:
            server_at = [at(wgroup, j % self.num_workers) for j in range(self.num_servers)]
        else:
            server_at = [at(sgroup, j) for j in range(self.num_servers)]
        extra = {k: v for k, v in (server_bundles or [{}])[0].items() if k != "CPU"}
        self.scheduler = role_cls.options(num_cpus=0, max_concurrency=2,
                                          scheduling_strategy=server_at[0]).remote()
        self.servers = [role_cls.options(num_cpus=self.cpus_per_server, resources=extra or None,
                                         max_concurrency=2, scheduling_strategy=s).remote()
                        for s in server_at]
        worker_cls = ray.remote(WorkerActor)
        self.workers = [worker_cls.options(num_cpus=self.cpus_per_worker,
                                           num_gpus=self.gpus_per_worker,
                                           scheduling_strategy=at(wgroup, i)).remote()
                        for i in range(self.num_workers)]
        limit = self.settings.timeout_s
        self.scheduler_node, port = self._get(
            [self.scheduler.node.remote(), self.scheduler.free_port.remote()], limit, "scheduler")
        self.server_nodes = self._get([s.node.remote() for s in self.servers], limit, "servers")
        self.worker_nodes = self._get([w.node.remote() for w in self.workers], limit, "workers")
        common = job_env(self.scheduler_node, port, self.num_workers, self.num_servers,
                         self.settings.secret, limit, self.settings.env)
        self._roles = serve_roles(self.scheduler, self.scheduler_node, self.servers,
                                  self.server_nodes, common)
        cls, args, kwargs = self._executable
        setups = [w.setup.remote(worker_env(common, i, node), cls, args, kwargs)
                  for i, (w, node) in enumerate(zip(self.workers, self.worker_nodes))]
        ranks = self._gather(setups, limit + 5.0, "joining the job")
        expected = [(i, self.num_workers) for i in range(self.num_workers)]
        if [tuple(r) for r in ranks] != expected:
            raise RayExecutorError(f"workers joined with (rank, size) {ranks}; expected {expected}")

    def _get(self, refs: List[Any], limit: float, what: str) -> List[Any]:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=limit)
        if len(ready) < len(refs):
            raise RayExecutorError(f"the {what} actors did not start within {limit:g} s "
                                   "(settings.timeout_s)")
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as err:
            raise RayExecutorError(f"a {what} actor failed to start: {describe(err)}") from err

    # -- running -------------------------------------------------------------------------

    def _where(self, rank: int) -> str:
        node = self.worker_nodes[rank] if rank < len(self.worker_nodes) else {}
        return f"worker rank {rank} (Ray node {node.get('ip', '?')} {node.get('node_id', '?')[:12]})"

    def _gather(self, refs: List[Any], limit: Optional[float], what: str) -> List[Any]:
        """The results of one call per worker, in rank order, watching the roles too."""
        if self._failed:
            raise RayExecutorError(f"this job has failed ({self._failed}); call shutdown() and "
                                   "start a new RayExecutor")
        rank_of = {ref: i for i, ref in enumerate(refs)}
        results: Dict[int, Any] = {}
        pending = list(refs) + list(self._roles)
        deadline = None if limit is None else time.monotonic() + limit
        failures: List[Tuple[int, str, BaseException]] = []  # (priority, message, error)
        while len(results) < len(refs):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0:
                raise RayExecutorError(f"workers {sorted(set(range(len(refs))) - set(results))} "
                                       f"did not finish {what} within {limit:g} s")
            ready, pending = ray.wait(pending, num_returns=1, timeout=left if left is not None else 1.0)
            for ref in ready:
                try:
                    value = ray.get(ref)
                except ray.exceptions.RayError as err:
                    failures.append(self._failure(rank_of.get(ref), ref, err))
                    continue
                if ref in rank_of:
                    results[rank_of[ref]] = value
                else:
                    failures.append((1, f"the {self._roles[ref]} ended while the workers were "
                                        f"{what}", None))
            if failures:
                break
        if not failures:
            return [results[i] for i in range(len(refs))]
        # Let the others report for a moment: a dead actor explains a peer's error.
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=_GRACE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                failures.append(self._failure(rank_of.get(ref), ref, err))
        failures.sort(key=lambda f: f[0])
        self._failed = failures[0][1]
        others = "; ".join(f[1] for f in failures[1:4])
        raise RayExecutorError(failures[0][1] + (f" (then: {others})" if others else "")) from failures[0][2]

    def _failure(self, rank: Optional[int], ref: Any, err: BaseException):
        who = self._where(rank) if rank is not None else f"the {self._roles.get(ref, 'role')}"
        if isinstance(err, ray.exceptions.RayActorError):
            return 0, f"{who} died: its Ray actor or node was lost ({describe(err)})", err
        return 2, f"{who} failed: {describe(err)}", err

    def run(self, fn: Callable, args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None,
            timeout_s: Optional[float] = None) -> List[Any]:
        """Calls ``fn(*args, **kwargs)`` on every worker; returns the results in rank order.

        Raises:
            RayExecutorError: a worker raised, or an actor or node died (named).
        """
        self._require()
        refs = [w.run.remote(fn, tuple(args), dict(kwargs or {})) for w in self.workers]
        return self._gather(refs, timeout_s, "running " + getattr(fn, "__name__", "fn"))

    def execute(self, fn: Callable[[Any], Any], timeout_s: Optional[float] = None) -> List[Any]:
        """Calls ``fn(executable)`` on every (live) worker, in rank order; ``executable`` is
        the worker's ``executable_cls`` instance, or None."""
        self._require()
        refs = [w.execute.remote(fn) for w in self.workers]
        return self._gather(refs, timeout_s, "executing " + getattr(fn, "__name__", "fn"))

    def _require(self) -> None:
        if not self.workers:
            raise RuntimeError("RayExecutor is not started: call start() first")

    # -- shutdown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leaves the job on every worker, lets the roles end, kills every actor and
        removes the placement groups (idempotent; nothing of the job keeps running)."""
        if self.workers and not self._failed:
            refs = [w.teardown.remote() for w in self.workers]
            ray.wait(refs, num_returns=len(refs), timeout=_TEARDOWN_S)
            if self._roles:  # the roles end by themselves once every worker has left
                ray.wait(list(self._roles), num_returns=len(self._roles), timeout=_TEARDOWN_S)
        kill_all([*self.workers, *self.servers, *([self.scheduler] if self.scheduler else [])],
                 self._groups)
        self.workers, self.servers, self.scheduler = [], [], None
        self._groups, self._roles, self._failed = [], {}, None

    def __enter__(self) -> "RayExecutor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()
