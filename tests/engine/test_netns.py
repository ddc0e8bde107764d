"""One job across two network namespaces (emulated hosts): scheduler and server on
host 0, workers on host 1 and host 0. Needs root; skips elsewhere."""

import os
import sys
from pathlib import Path

import pytest

from bpstrain.bench import emulated

SCRIPTS = Path(__file__).parent / "scripts"
ok, why = emulated.available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not ok, reason=why or "netns available")]


@pytest.mark.timeout(120)
def test_job_spans_two_namespaces():
    with emulated.EmulatedCluster(hosts=2, rate_mbit=200) as cluster:
        port = 24111
        base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
        base.update(DMLC_PS_ROOT_URI=cluster.addr(0), DMLC_PS_ROOT_PORT=str(port),
                    DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1", PYTHONUNBUFFERED="1")
        procs = [
            cluster.popen(0, [sys.executable, "-m", "bpstrain.launch"], env={**base, "DMLC_ROLE": "scheduler"}),
            cluster.popen(0, [sys.executable, "-m", "bpstrain.launch"],
                          env={**base, "DMLC_ROLE": "server", "DMLC_NODE_HOST": cluster.addr(0)}),
        ]
        workers = [
            cluster.popen(h, [sys.executable, str(SCRIPTS / "check_dtypes.py")],
                          env={**base, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(h)},
                          stdout=-1, stderr=-2, text=True)
            for h in (0, 1)
        ]
        outs = [w.communicate(timeout=90)[0] for w in workers]
        for p in procs:
            assert p.wait(timeout=30) == 0
        for w, out in zip(workers, outs):
            assert w.returncode == 0 and "DTYPES_OK" in out, out
