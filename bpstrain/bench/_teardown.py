"""Close registered resources at interpreter exit and on SIGINT/SIGTERM.

Emulated clusters create kernel objects (network namespaces, veth pairs) that
outlive the Python process unless someone deletes them. Every live cluster
registers here; the first registration installs an ``atexit`` hook and signal
handlers that close all registered resources and then hand the signal to the
handler that was installed before (chaining), so Ctrl-C still raises
``KeyboardInterrupt`` and SIGTERM still terminates the process.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from typing import Protocol

_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_lock = threading.RLock()
_live: list["_Closable"] = []
_previous: dict[int, object] = {}
_atexit_installed = False


class _Closable(Protocol):
    def close(self) -> None: ...


def register(resource: _Closable) -> None:
    """Closes ``resource`` at exit or on SIGINT/SIGTERM unless unregistered first."""
    global _atexit_installed
    with _lock:
        _live.append(resource)
        if not _atexit_installed:
            atexit.register(close_all)
            _atexit_installed = True
        _install_signal_handlers()


def unregister(resource: _Closable) -> None:
    """Forgets ``resource``; restores the old signal handlers when none is left."""
    with _lock:
        if resource in _live:
            _live.remove(resource)
        if not _live:
            _restore_signal_handlers()


def close_all() -> None:
    """Closes every registered resource; errors are swallowed so all get a turn."""
    with _lock:
        pending = list(reversed(_live))
    for resource in pending:
        try:
            resource.close()
        except Exception:  # noqa: BLE001 - teardown must reach every resource
            pass


def _install_signal_handlers() -> None:
    # signal.signal only works in the main thread; elsewhere atexit and the
    # context manager still clean up, so silently skip.
    if _previous or threading.current_thread() is not threading.main_thread():
        return
    for signum in _SIGNALS:
        # A process that ignores the signal (e.g. SIGINT in a background job)
        # must keep ignoring it: cleaning up would pull the cluster from under it.
        if signal.getsignal(signum) == signal.SIG_IGN:
            continue
        try:
            _previous[signum] = signal.signal(signum, _on_signal)
        except (ValueError, OSError):
            pass


def _restore_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in list(_previous.items()):
        # Leave a handler that somebody installed after us alone.
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, handler)  # type: ignore[arg-type]
        del _previous[signum]


def _on_signal(signum: int, frame) -> None:
    previous = _previous.get(signum, signal.SIG_DFL)
    close_all()
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        # Re-deliver with the default action (e.g. terminate on SIGTERM).
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    # SIG_IGN: the process asked to ignore it; cleanup was the only effect.
