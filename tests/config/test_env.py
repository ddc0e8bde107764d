"""BytePS's variables read exactly as BytePS reads them (bpstrain.config.env)."""

import pytest

from bpstrain.config.env import read_env
from bpstrain.errors import ConfigError

pytestmark = pytest.mark.timeout(30)
JOB = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9000"}


def test_num_worker_counts_hosts_of_local_size_processes():
    # A BytePS job of 2 hosts x 4 processes started by hand: size 8.
    env = read_env({**JOB, "DMLC_NUM_WORKER": "2", "BYTEPS_LOCAL_SIZE": "4",
                    "DMLC_WORKER_ID": "1", "BYTEPS_LOCAL_RANK": "3"})
    assert (env.num_worker_hosts, env.local_size, env.num_workers) == (2, 4, 8)
    assert env.rank_hint == 1 * 4 + 3
    assert env.local_size_given


def test_one_process_per_host_by_default():
    env = read_env({**JOB, "DMLC_NUM_WORKER": "3", "DMLC_WORKER_ID": "2"})
    assert (env.num_workers, env.rank_hint, env.local_size_given) == (3, 2, False)


def test_worker_id_must_name_one_of_the_hosts():
    with pytest.raises(ConfigError, match=r"DMLC_WORKER_ID must be < DMLC_NUM_WORKER .*"
                       r"Received: DMLC_WORKER_ID=2, DMLC_NUM_WORKER=2"):
        read_env({**JOB, "DMLC_NUM_WORKER": "2", "BYTEPS_LOCAL_SIZE": "4", "DMLC_WORKER_ID": "2"})


def test_mixed_mode_host_id_and_hierarchical_variables():
    env = read_env({**JOB, "BYTEPS_ENABLE_MIXED_MODE": "0", "BPSTRAIN_HOST_ID": "rack1-n3",
                    "BPSTRAIN_HIERARCHICAL": "1"})
    assert (env.mixed_mode, env.host_id, env.comm["hierarchical"]) == (False, "rack1-n3", "true")
    assert read_env(JOB).mixed_mode is True
    assert read_env({**JOB, "BPSTRAIN_HIERARCHICAL": "auto"}).comm["hierarchical"] == "auto"
    with pytest.raises(ConfigError, match=r"BPSTRAIN_HIERARCHICAL must be one of auto, true, "
                       r"false\. Received: BPSTRAIN_HIERARCHICAL='maybe'"):
        read_env({**JOB, "BPSTRAIN_HIERARCHICAL": "maybe"})
