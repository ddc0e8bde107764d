"""``python -m bpstrain.launch k8s``: manifests valid for the real schema, and their shape."""

import io
import re
import subprocess
import sys

import pytest
import yaml
from launch_helpers import HERE, REPO, subprocess_env

from bpstrain.config.env import read_env
from bpstrain.launch._cli import main
from bpstrain.launch.k8s import WAIT_FOR_SCHEDULER

K8S_VERSION = "1.30.0"
FULL = ["--workers", "8", "--local-size", "2", "--servers", "3", "--image", "reg.io/team/train:1",
        "--namespace", "ml", "--name", "resnet", "--gpus-per-worker", "1",
        "--cpu-per-worker", "1.5", "--memory-per-worker", "3Gi", "--secret-name", "team-secret",
        "--port", "9100", "--", "python", "train.py", "--lr", "0.1"]
MINIMAL = ["--workers", "2", "--image", "img", "--", "python", "train.py"]


def render(argv):
    """The documents ``k8s argv`` prints, parsed."""
    out = io.StringIO()
    from bpstrain.launch.k8s import main as k8s_main
    assert k8s_main(argv, out) == 0
    return list(yaml.safe_load_all(out.getvalue()))


def by_kind(docs):
    kinds = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    return kinds


def container(job):
    return job["spec"]["template"]["spec"]["containers"][0]


def env_of(job):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(job)["env"]}


def test_output_passes_kubernetes_validate_strict(tmp_path):
    pytest.importorskip("kubernetes_validate")
    files = []
    for i, argv in enumerate((MINIMAL, FULL)):
        run = subprocess.run([sys.executable, "-m", "bpstrain.launch", "k8s", *argv],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        files.append(tmp_path / f"job{i}.yaml")
        files[-1].write_text(run.stdout)
    check = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict",
                            "--kubernetes-version", K8S_VERSION, *map(str, files)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert len(re.findall(r"passed for resource", check.stdout)) == 5 + 4, check.stdout


def test_objects_names_counts_and_fail_fast_policy():
    kinds = by_kind(render(FULL))
    assert set(kinds) == {"Service", "Job"}  # --secret-name: no Secret generated
    assert set(kinds["Job"]) == {"resnet-scheduler", "resnet-servers", "resnet-workers"}
    pods = {name: job["spec"]["completions"] for name, job in kinds["Job"].items()}
    assert pods == {"resnet-scheduler": 1, "resnet-servers": 3, "resnet-workers": 4}
    for job in kinds["Job"].values():
        spec = job["spec"]
        assert job["metadata"]["namespace"] == "ml"
        assert spec["completionMode"] == "Indexed"
        assert spec["parallelism"] == spec["completions"]
        assert spec["backoffLimit"] == 0
        assert spec["template"]["spec"]["restartPolicy"] == "Never"
        assert container(job)["image"] == "reg.io/team/train:1"
    assert container(kinds["Job"]["resnet-workers"])["args"] == [
        "--", "python", "train.py", "--lr", "0.1"]


def test_headless_service_selects_the_scheduler_and_is_every_roles_root_uri():
    kinds = by_kind(render(FULL))
    service = kinds["Service"]["resnet-scheduler"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"][0]["port"] == 9100
    scheduler = kinds["Job"]["resnet-scheduler"]
    selector = service["spec"]["selector"].items()
    assert selector <= scheduler["spec"]["template"]["metadata"]["labels"].items()
    for name, job in kinds["Job"].items():
        assert not selector <= job["spec"]["template"]["metadata"]["labels"].items() \
            or name == "resnet-scheduler"
        env = env_of(job)
        assert env["DMLC_PS_ROOT_URI"] == "resnet-scheduler.ml.svc"
        assert env["DMLC_PS_ROOT_PORT"] == "9100"
        assert (env["DMLC_NUM_WORKER"], env["DMLC_NUM_SERVER"]) == ("4", "3")
        assert env["BYTEPS_LOCAL_SIZE"] == "2"
        assert env["BPSTRAIN_SECRET"] == {"secretKeyRef": {"name": "team-secret",
                                                           "key": "secret"}}
    assert env_of(scheduler)["BPSTRAIN_LISTEN_HOST"] == "0.0.0.0"
    # Without --namespace: the short name, resolved in the pods' own namespace.
    minimal = by_kind(render(MINIMAL))
    assert env_of(minimal["Job"]["bpstrain-workers"])["DMLC_PS_ROOT_URI"] == "bpstrain-scheduler"


def test_servers_and_workers_take_their_ids_from_the_completion_index_and_advertise_pod_ip():
    jobs = by_kind(render(FULL))["Job"]
    index = {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    for name, var in (("resnet-servers", "DMLC_SERVER_ID"), ("resnet-workers", "DMLC_WORKER_ID")):
        env = env_of(jobs[name])
        assert env[var] == index
        assert env["DMLC_NODE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["DMLC_ROLE"] == name.split("-")[1][:-1]
        assert "BPSTRAIN_LISTEN_HOST" not in env  # they bind their pod IP
        init = jobs[name]["spec"]["template"]["spec"]["initContainers"][0]
        assert init["command"][-1] == WAIT_FOR_SCHEDULER
    assert "DMLC_NODE_HOST" not in env_of(jobs["resnet-scheduler"])


def _resolved(job, index, pod_ip=None):
    """The environment Kubernetes would give pod ``index`` of ``job``."""
    values = {"status.podIP": pod_ip or f"10.0.0.{index + 1}"}
    env = {}
    for name, value in env_of(job).items():
        if isinstance(value, str):
            env[name] = value
        elif "secretKeyRef" in value:
            env[name] = "s3cret"
        else:
            env[name] = values.get(value["fieldRef"]["fieldPath"], str(index))
    return env


def test_bpstrain_reads_the_rendered_environment_as_intended():
    jobs = by_kind(render(FULL))["Job"]
    ranks = []
    for index in range(4):
        cluster = read_env(_resolved(jobs["resnet-workers"], index))
        assert (cluster.role, cluster.num_workers, cluster.num_servers) == ("worker", 8, 3)
        assert cluster.node_host == f"10.0.0.{index + 1}"
        ranks.append(cluster.rank_hint)
    assert ranks == [0, 2, 4, 6]  # rank = worker id * local size + local rank
    servers = [read_env(_resolved(jobs["resnet-servers"], i)).server_id for i in range(3)]
    assert servers == [0, 1, 2]
    scheduler = read_env(_resolved(jobs["resnet-scheduler"], 0))
    assert (scheduler.root_uri, scheduler.root_port) == ("resnet-scheduler.ml.svc", 9100)
    assert (scheduler.listen_host, scheduler.num_worker_hosts) == ("0.0.0.0", 4)


@pytest.mark.timeout(120)
def test_pods_started_as_the_manifests_say_form_a_job_with_correct_sums():
    """Every pod's container command and environment, run here (pod IP 127.0.0.1, the
    Service name replaced by localhost): 1 scheduler, 1 server, 2 worker pods of 2."""
    from bpstrain.launch import free_port
    argv = ["--workers", "4", "--local-size", "2", "--servers", "1", "--image", "img",
            "--port", str(free_port()), "--rendezvous-timeout", "60",
            "--python", sys.executable, "--", sys.executable, str(HERE / "e2e_worker.py")]
    jobs = by_kind(render(argv))["Job"]
    procs = []
    try:
        for name in ("bpstrain-scheduler", "bpstrain-servers", "bpstrain-workers"):
            for index in range(jobs[name]["spec"]["completions"]):
                env = _resolved(jobs[name], index, pod_ip="127.0.0.1")
                env["DMLC_PS_ROOT_URI"] = "localhost"
                init = jobs[name]["spec"]["template"]["spec"].get("initContainers", [])
                for step in (*init, container(jobs[name])):
                    cmd = [*step["command"], *step.get("args", [])]
                    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(**env),
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True)
                    if step is not container(jobs[name]):
                        assert proc.wait(timeout=30) == 0, proc.stdout.read()
                    else:
                        procs.append(proc)
        outputs = [p.communicate(timeout=90)[0] for p in reversed(procs)][::-1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * 4, outputs
    for rank in range(4):
        assert f"rank {rank} of 4: sum 10 expected 10" in outputs[2 + rank // 2], outputs


def test_resources_gpu_requests_and_shared_memory():
    jobs = by_kind(render(FULL))["Job"]
    worker = container(jobs["resnet-workers"])
    assert worker["resources"] == {
        "requests": {"cpu": "3", "memory": "6Gi", "nvidia.com/gpu": "2"},  # per process x 2
        "limits": {"nvidia.com/gpu": "2"}}
    assert worker["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert container(jobs["resnet-servers"])["resources"] == {
        "requests": {"cpu": "2", "memory": "2Gi"}}
    plain = by_kind(render(MINIMAL))["Job"]
    for job in plain.values():
        assert "nvidia.com/gpu" not in str(container(job)["resources"])
        assert "volumes" not in job["spec"]["template"]["spec"]


def test_generated_secret_is_random_and_referenced():
    first, second = by_kind(render(MINIMAL)), by_kind(render(MINIMAL))
    secret = first["Secret"]["bpstrain-secret"]
    value = secret["stringData"]["secret"]
    assert re.fullmatch(r"[0-9a-f]{64}", value)
    assert value != second["Secret"]["bpstrain-secret"]["stringData"]["secret"]
    for job in first["Job"].values():
        assert env_of(job)["BPSTRAIN_SECRET"] == {"secretKeyRef": {"name": "bpstrain-secret",
                                                                   "key": "secret"}}


def test_wait_for_scheduler_script_returns_once_the_name_resolves(monkeypatch):
    monkeypatch.setenv("DMLC_PS_ROOT_URI", "localhost")
    monkeypatch.setenv("BPSTRAIN_RENDEZVOUS_TIMEOUT", "5")
    exec(compile(WAIT_FOR_SCHEDULER, "wait-for-scheduler", "exec"), {})


BAD_ARGS = [
    (["--workers", "3", "--local-size", "2", "--image", "i", "--", "t"],
     r"--workers must be a multiple of --local-size .*Received: --workers=3, --local-size=2"),
    (["--workers", "2", "--image", "i"], r"no worker command given.*Received: CMD=\[\]"),
    (["--workers", "2", "--", "t"], r"the following arguments are required: --image"),
    (["--image", "i", "--", "t"], r"the following arguments are required: --workers"),
    (["--workers", "2", "--servers", "0", "--image", "i", "--", "t"],
     r"--servers: expected an integer >= 1\. Received: --servers='0'"),
    (["--workers", "2", "--image", "i", "--name", "My_Job", "--", "t"],
     r"--name: expected a DNS label starting with a letter.*Received: --name='My_Job'"),
    (["--workers", "2", "--image", "i", "--namespace", "ML", "--", "t"],
     r"--namespace: expected a DNS label.*Received: --namespace='ML'"),
    (["--workers", "2", "--image", "i", "--memory-per-worker", "4GB", "--", "t"],
     r"expected a Kubernetes quantity such as 2, 500m, 4Gi\. "
     r"Received: --memory-per-worker='4GB'"),
    (["--workers", "2", "--image", "i", "--gpus-per-worker", "-1", "--", "t"],
     r"Received: --gpus-per-worker='-1'"),
    (["--workers", "2", "--image", "my image", "--", "t"],
     r"--image must be an image reference without spaces\. Received: --image='my image'"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGS)
def test_bad_arguments_exit_2_with_a_clear_message(argv, message, capsys):
    try:
        status = main(["k8s", *argv], environ={})
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    assert status == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.search(message, captured.err), captured.err
    assert "bpstrain.launch k8s" in captured.err


def test_k8s_is_a_worker_command_when_a_role_is_set(capsys):
    assert main(["k8s"], environ={"DMLC_ROLE": "boss"}) == 2
    assert "DMLC_ROLE must be one of" in capsys.readouterr().err
