"""Fixtures shared by the test folders."""

import os
import signal

import pytest

# A shell runs background jobs with SIGINT ignored, and an ignored signal stays ignored in
# every child: the Ctrl-C tests would then test nothing. Python's own handler here makes
# children start with the default disposition again (a handled signal resets on exec).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
