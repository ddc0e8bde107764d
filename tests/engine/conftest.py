"""Engine tests that take the ``transport`` fixture run over TCP, over the in-process
transport (gloo's parameterized-transport tests) and, where this build has UCX and the
machine has libucp, over UCX's TCP lanes (``ucx:tcp``)."""

import pytest

from tests.engine import harness


def _ucx_available() -> bool:
    from bpstrain import _core
    from bpstrain.errors import BpsError

    try:
        _core.check_transport("ucx:tcp")
        return True
    except (AttributeError, BpsError, ValueError):
        return False


TRANSPORTS = ["tcp", "inproc"] + (["ucx:tcp"] if _ucx_available() else [])


@pytest.fixture(params=TRANSPORTS)
def transport(request, monkeypatch):
    monkeypatch.setattr(harness, "DEFAULT_TRANSPORT", request.param)
    return request.param
