"""Fixtures shared by the test folders."""

import os

import pytest


@pytest.fixture
def standalone_engine(monkeypatch):
    """bpstrain.engine initialised alone (rank 0 of 1): no cluster variables, shut down after."""
    from bpstrain import engine

    for name in [n for n in os.environ if n.startswith(("DMLC_", "BYTEPS_"))]:
        monkeypatch.delenv(name)
    engine.shutdown()
    engine.init()
    yield engine
    engine.shutdown()
