"""RayExecutor on a real 5-node Ray cluster (a head and 4 nodes, see conftest.py)."""

import signal
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason='Ray is not installed: pip install -e ".[ray]"')
psutil = pytest.importorskip("psutil")

from bpstrain.ray import RayExecutor, RayExecutorError  # noqa: E402

pytestmark = pytest.mark.timeout(240)
# The functions below run in Ray workers, which cannot import this test module by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _push_pull_rank():
    import bpstrain.engine as bps

    total = bps.push_pull(np.full(1000, bps.rank() + 1, np.float32), name="r", average=False)
    return bps.rank(), bps.size(), float(total[0]), float(total[-1])


def _node_of_this_actor():
    return ray.get_runtime_context().get_node_id()


def _role_actors_left(executor_pids):
    """Processes of the job's actors still alive (by pid and Ray's process title)."""
    alive = []
    for pid in executor_pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append((pid, " ".join(proc.cmdline())[:80]))
        except psutil.NoSuchProcess:
            pass
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if "RoleActor" in line or "WorkerActor" in line:
            alive.append((proc.pid, line[:80]))
    return alive


def _wait_gone(pids, limit=20.0):
    deadline = time.monotonic() + limit
    while (left := _role_actors_left(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _pids(executor):
    return [n["pid"] for n in executor.worker_nodes + executor.server_nodes
            + [executor.scheduler_node]]


def test_four_workers_sum_in_rank_order_spread_over_nodes_with_servers_beside_them(ray_cluster):
    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=4, num_servers=2, cpus_per_worker=1)
    executor.start()
    pids = _pids(executor)
    try:
        print(f"cluster up in {ray_cluster.started_s:.1f} s; job formed in "
              f"{executor.start_seconds:.2f} s (4 workers, 2 servers, 5-node Ray cluster)")
        results = executor.run(_push_pull_rank)
        assert [r[:2] for r in results] == [(i, 4) for i in range(4)]
        assert all(r[2:] == (10.0, 10.0) for r in results)  # 1+2+3+4
        worker_nodes = [n["node_id"] for n in executor.worker_nodes]
        assert len(set(worker_nodes)) == 4  # distinct nodes
        assert executor.run(_node_of_this_actor) == worker_nodes  # run is in rank order
        # Servers spread over the workers' nodes: server j beside worker j.
        assert [n["node_id"] for n in executor.server_nodes] == worker_nodes[:2]
        # execute() on the live workers, again in rank order, a second op in the same job.
        assert executor.execute(lambda _: _push_pull_rank()[2]) == [10.0] * 4
    finally:
        executor.shutdown()
    assert _wait_gone(pids) == []


def test_servers_go_to_the_nodes_server_resources_ask_for(ray_cluster):
    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=2, num_servers=2,
                           server_resources={"cpu_node": 1})
    with executor:
        pids = _pids(executor)
        results = executor.run(_push_pull_rank)
        assert [r[2] for r in results] == [3.0, 3.0]
        names = ray_cluster.node_ids
        servers = sorted(names[n["node_id"]] for n in executor.server_nodes)
        assert servers == ["node_3", "node_4"]
        assert names[executor.scheduler_node["node_id"]] in ("node_3", "node_4")
        workers = [names[n["node_id"]] for n in executor.worker_nodes]
        assert len(set(workers)) == 2
    assert _wait_gone(pids) == []


def _slow_steps(steps):
    import bpstrain.engine as bps

    for i in range(steps):
        bps.push_pull(np.ones(256, np.float32), name=f"s{i}", average=False)
        time.sleep(0.1)
    return bps.rank()


def test_a_killed_worker_actor_is_a_clear_error_and_shutdown_leaves_nothing(ray_cluster):
    settings = RayExecutor.create_settings(timeout_s=60, env={"BPSTRAIN_OP_TIMEOUT": "20"})
    executor = RayExecutor(settings, num_workers=3, num_servers=1)
    executor.start()
    pids = _pids(executor)
    try:
        refs_started = time.monotonic()
        victim = executor.workers[1]

        def kill_soon():
            time.sleep(1.5)
            ray.kill(victim, no_restart=True)

        import threading

        threading.Thread(target=kill_soon, daemon=True).start()
        with pytest.raises(RayExecutorError) as info:
            executor.run(_slow_steps, args=(600,))
        message = str(info.value)
        print("killed worker ->", message)
        assert "worker rank 1" in message and "died" in message, message
        assert time.monotonic() - refs_started < 30
        with pytest.raises(RayExecutorError, match="has failed"):
            executor.run(_push_pull_rank)
    finally:
        executor.shutdown()
    assert _wait_gone(pids) == []


def test_placement_that_cannot_be_met_is_a_clear_error(ray_cluster):
    settings = RayExecutor.create_settings(placement_group_timeout_s=3)
    executor = RayExecutor(settings, num_workers=2, num_servers=1,
                           server_resources={"no_such_resource": 1})
    with pytest.raises(RayExecutorError, match="was not placed within 3 s"):
        executor.start()
    assert executor.workers == [] and executor._groups == []


# -- Ray Train: BpstrainTrainer ---------------------------------------------------------


def _train_loop(config):
    import json
    import os

    import bpstrain.engine as bps

    bps.init()  # the backend formed the job already: a no-op
    total = bps.push_pull(np.full(8, bps.rank() + 1, np.float32), name="t", average=False)
    info = {"rank": bps.rank(), "size": bps.size(), "sum": float(total[0]),
            "world_rank": ray.train.get_context().get_world_rank(),
            "node": ray.get_runtime_context().get_node_id()}
    with open(os.path.join(config["out"], f"rank{bps.rank()}.json"), "w") as f:
        json.dump(info, f)
    ray.train.report({"sum": float(total[0])})


def test_bpstrain_trainer_fits_on_ray_train_with_servers_on_cpu_nodes(ray_cluster, tmp_path):
    pytest.importorskip("ray.train", reason='Ray Train is not installed: pip install "ray[train]"')
    import json

    from ray.train import RunConfig, ScalingConfig

    from bpstrain.ray import BpstrainConfig, BpstrainTrainer

    trainer = BpstrainTrainer(
        _train_loop, train_loop_config={"out": str(tmp_path)},
        # gpu_node: 1 per worker puts the two workers on nodes 1 and 2.
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1, "gpu_node": 1}),
        bpstrain_config=BpstrainConfig(num_servers=2, server_resources={"cpu_node": 1}),
        run_config=RunConfig(storage_path=str(tmp_path / "results"), name="bps"))
    handler = signal.getsignal(signal.SIGINT)
    result = trainer.fit()
    assert result.error is None
    # Ray Train's own Ctrl-C handler must not outlive the run (a later Ctrl-C would start
    # a new Ray instance to abort a controller that is gone).
    assert signal.getsignal(signal.SIGINT) is handler
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(i["rank"], i["world_rank"], i["size"], i["sum"]) for i in infos] == [
        (0, 0, 2, 3.0), (1, 1, 2, 3.0)]
    assert sorted(ray_cluster.node_ids[i["node"]] for i in infos) == ["node_1", "node_2"]
    assert _wait_gone([]) == []


# -- Trainer(config).fit with cluster.launcher: ray --------------------------------------


def test_trainer_fit_with_cluster_launcher_ray_trains_on_actors(ray_cluster, tmp_path):
    torch = pytest.importorskip("torch")
    from bpstrain.trainer import Trainer
    from tests.trainer.helpers import base_config, blobs, tiny_net

    x, y = blobs(256)
    model = tiny_net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(base_config(tmp_path, **{"cluster.workers": 2, "cluster.servers": 1,
                                               "cluster.launcher": "ray", "trainer.epochs": 2,
                                               "comm.op_timeout": 30.0}))
    history = trainer.fit(model, (x, y), val_data=(x, y))
    assert len(history) == 2 and history.last["val_accuracy"] > 0.5
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():  # rank 0's trained weights came back
        accuracy = (model(torch.from_numpy(x)).argmax(1).numpy() == y).mean()
    assert accuracy == pytest.approx(history.last["val_accuracy"], abs=1e-6)
    assert (trainer.run_dir / "config.yaml").is_file()  # rank 0's node is this machine
    assert _wait_gone([]) == []


# -- last: it removes a node from the module's cluster ----------------------------------


def test_a_lost_node_is_a_clear_error_naming_the_worker_on_it(ray_cluster):
    settings = RayExecutor.create_settings(timeout_s=60, env={"BPSTRAIN_OP_TIMEOUT": "20"})
    executor = RayExecutor(settings, num_workers=2, num_servers=1,
                           placement_strategy="STRICT_SPREAD")
    executor.start()
    pids = _pids(executor)
    try:
        lost = ray_cluster.nodes[executor.worker_nodes[1]["node_id"]]
        import threading

        threading.Thread(target=lambda: (time.sleep(1.5), ray_cluster.remove_node(lost, False)),
                         daemon=True).start()
        with pytest.raises(RayExecutorError) as info:
            executor.run(_slow_steps, args=(600,))
        message = str(info.value)
        print("lost node ->", message)
        assert message.startswith("worker rank 1") and "died" in message, message
    finally:
        executor.shutdown()
    assert _wait_gone(pids) == []
