"""Imports MXNet 1.9 for the adapter, with the numpy shim it needs on numpy 1.24-1.26.

MXNet 1.9.1 (the last release) still reads ``numpy.bool``, which numpy 1.24 removed
(apache/mxnet#21165): its import fails on numpy 1.24-1.26 unless the alias is back.
It is restored (to the builtin ``bool``, what the alias always was) before MXNet is
imported, only when it is missing; numpy 1.23 needs nothing and numpy 2 is refused by
MXNet itself (it requires numpy < 2).
"""

from __future__ import annotations

import numpy as np

_INSTALL = ("install it with `pip install 'bpstrain[mxnet]'` (mxnet==1.9.1 needs numpy<2, "
            "so it usually gets a virtual environment of its own; see the README's MXNet section)")


def import_mxnet():
    """Returns the ``mxnet`` module, after the ``numpy.bool`` shim where numpy lacks it.

    Raises:
        ImportError: MXNet is not installed, or does not import with this numpy.
    """
    if "bool" not in vars(np):  # numpy 1.24-1.26; `hasattr` would only warn on 1.20-1.23
        np.bool = bool
    try:
        import mxnet
    except ImportError as exc:
        raise ImportError(f"bpstrain.mxnet needs MXNet 1.9 ({exc}); {_INSTALL}. "
                          f"Received: numpy {np.__version__}") from exc
    return mxnet
