"""Engine tests that take the ``transport`` fixture run over TCP and over the
in-process transport (gloo's parameterized-transport tests)."""

import pytest

from tests.engine import harness


@pytest.fixture(params=["tcp", "inproc"])
def transport(request, monkeypatch):
    monkeypatch.setattr(harness, "DEFAULT_TRANSPORT", request.param)
    return request.param
