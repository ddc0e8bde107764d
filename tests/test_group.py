"""bpstrain._group, the framework-neutral group code of the TF and Keras adapters."""

import numpy as np
import pytest

from bpstrain import _group, engine


@pytest.mark.timeout(30)
def test_group_keeps_scalar_shapes_and_unique_names(standalone_engine):
    out = _group.push_pull_group([np.float64(2.5), np.ones((2, 0))], ["s", "e"])
    assert out[0].shape == () and out[0] == 2.5 and out[1].shape == (2, 0)
    assert _group.unique_names(["a", "b", "a", "a"]) == ["a", "b", "a#1", "a#2"]


@pytest.mark.timeout(30)
def test_group_waits_for_every_started_handle_then_raises(standalone_engine):
    with pytest.raises(ValueError, match="unsupported dtype"):
        _group.broadcast_group([np.ones(2), np.ones(2, np.complex64)], ["a", "b"], root_rank=0)
    assert not engine._require().ops  # the first array's handle was synchronized


def test_average_divides_like_the_engine():
    assert _group.average(np.array([-3, 7], np.int32), 2).tolist() == [-2, 3]  # floor
    out = _group.average(np.array([1.0, 3.0], np.float16), 2)
    assert out.dtype == np.float16 and out.tolist() == [0.5, 1.5]


def test_group_code_imports_no_framework():
    import subprocess
    import sys

    probe = ("import sys; import bpstrain._group; "
             "print(sorted(m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
