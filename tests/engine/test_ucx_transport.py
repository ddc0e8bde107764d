"""The UCX transport beyond the in-process engine suite (which tests/engine/conftest.py
also runs over ucx:tcp): how it says it is unavailable, and jobs of separate processes
over UCX's shared-memory and TCP lanes, including a worker killed mid-job."""

import os
import subprocess
import sys
import textwrap

import pytest

from bpstrain import _core
from bpstrain.errors import ConfigError
from tests.engine.conftest import TRANSPORTS

needs_ucx = pytest.mark.skipif("ucx:tcp" not in TRANSPORTS,
                               reason="no UCX in this build or on this machine (bash .ci/install-ucx)")

JOB = textwrap.dedent("""
    import os, sys, numpy as np
    import bpstrain.engine as bps
    bps.init()
    r = bps.rank()
    x = np.full(1 << 20, r + 1.0, np.float32)          # 4 MB: UCX's rendezvous path
    for step in range(3):
        if step == 2 and r == 1 and os.environ.get("KILL_RANK_1"):
            os._exit(9)                                 # dies without a word
        y = bps.push_pull(x, name="x", average=False)
        assert float(y.min()) == float(y.max()) == 3.0, (step, y[:4])
    print(f"rank {r} ok", flush=True)
    bps.shutdown()
""")


def _launch(tmp_path, transport, **env):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return subprocess.run(
        [sys.executable, "-m", "bpstrain.launch", "--workers", "2", "--servers", "2", "--",
         sys.executable, str(script)],
        env={**os.environ, "BPSTRAIN_TRANSPORT": transport, "BPSTRAIN_TIMEOUT": "10", **env},
        capture_output=True, text=True, timeout=90)


def test_a_malformed_ucx_name_is_a_config_error():
    with pytest.raises(ConfigError, match="ucx:<UCX_TLS list>"):
        _core.check_transport("ucx:")
    with pytest.raises(ConfigError, match="expected one of tcp, inproc, ucx"):
        _core.check_transport("rdma")


@pytest.mark.parametrize("version,proto_enable,rndv_thresh,tls,v2,eager", [
    ((1, 13), None, None, "tcp", False, True),     # protocols v1: bodies eager over TCP
    ((1, 15), None, None, "tcp", False, True),
    ((1, 16), None, None, "tcp", True, False),     # v2 the default: UCX's rendezvous
    ((1, 22), None, None, "tcp", True, False),
    ((2, 0), None, None, "tcp", True, False),
    ((1, 22), "n", None, "tcp", False, True),      # the user's UCX_PROTO_ENABLE decides
    ((1, 22), "OFF", None, "tcp", False, True),
    ((1, 22), "0", None, "tcp", False, True),
    ((1, 13), "y", None, "tcp", True, False),
    ((1, 13), "", None, "tcp", False, True),       # empty is unset
    ((1, 13), None, "8k", "tcp", False, False),    # the user's UCX_RNDV_THRESH is kept
    ((1, 13), None, None, "sm,tcp", False, False),  # lists beyond TCP keep UCX's threshold
    ((1, 13), None, None, "", False, False),       # UCX picks
])
def test_frame_bodies_go_eagerly_only_with_protocols_v1_over_tcp_alone(version, proto_enable, rndv_thresh,
                                                                       tls, v2, eager):
    assert _core.ucx_rules(*version, proto_enable, rndv_thresh, tls) == \
        {"protocols_v2": v2, "eager_bodies": eager}


@needs_ucx
@pytest.mark.timeout(60)
@pytest.mark.parametrize("users_sndbuf", [None, "262144"])
def test_the_transport_s_ucx_settings_do_not_leak_into_child_processes(users_sndbuf):
    # The engine sets UCX_TCP_SNDBUF and UCX_TCP_CM_REUSEADDR for its own context only; a
    # process it starts afterwards sees the user's environment, a user's value untouched.
    code = textwrap.dedent("""
        import subprocess
        from bpstrain import _core
        _core.check_transport("ucx:tcp")
        print(subprocess.run(["env"], capture_output=True, text=True, check=True).stdout)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_TCP_")}
    if users_sndbuf:
        env["UCX_TCP_SNDBUF"] = users_sndbuf
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stderr
    child = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    assert "UCX_TCP_CM_REUSEADDR" not in child
    assert child.get("UCX_TCP_SNDBUF") == users_sndbuf


@pytest.mark.timeout(60)
def test_without_libucp_the_error_says_what_to_install():
    code = "from bpstrain import _core\n_core.check_transport('ucx')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "BPSTRAIN_UCX_LIB": "/nonexistent/libucp.so.0"})
    assert out.returncode != 0
    assert ("cannot load /nonexistent/libucp.so.0" in out.stderr and "libucx0" in out.stderr) \
        or "found no UCX headers" in out.stderr, out.stderr


@needs_ucx
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["ucx:tcp", "ucx:sm,tcp"])
def test_a_job_of_processes_sums_over_ucx(tmp_path, transport):
    out = _launch(tmp_path, transport)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0 ok" in out.stdout and "rank 1 ok" in out.stdout, out.stdout


@needs_ucx
@pytest.mark.timeout(120)
def test_a_killed_worker_fails_the_job_with_a_clear_error_over_ucx(tmp_path):
    out = _launch(tmp_path, "ucx:tcp", KILL_RANK_1="1")
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "rank 0 ok" not in text, text
    assert "worker 1" in text and ("closed its connection" in text or "exited with code" in text), text
