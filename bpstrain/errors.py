"""Exception types of bpstrain, shared by the engine and every adapter.

The C++ engine raises these through one translator (``core_ext/bindings/module.cc``);
Python code raises them directly. They follow Horovod's conventions: cross-rank
disagreements are ``RuntimeError`` subclasses, bad arguments and configuration are
``ValueError`` subclasses.
"""


class BpsError(RuntimeError):
    """Base class of runtime failures of the distributed engine."""


class MismatchError(BpsError):
    """A tensor name is used with different shapes or dtypes on different ranks."""


class PeerError(BpsError):
    """A peer (worker, server or scheduler) died, hung or closed its connection."""


class BpsTimeoutError(BpsError, TimeoutError):
    """A blocking call did not complete within its timeout."""


class ShutdownError(BpsError):
    """The engine was shut down while an operation was still running."""


class ConfigError(ValueError):
    """Invalid configuration, environment variable or argument."""
