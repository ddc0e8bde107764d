"""The job a notebook-side ``fit`` ships to its workers, with tracebacks that name your file.

cloudpickle ships classes and functions defined in ``__main__`` or a notebook by value,
and (for reproducible bytes) renames their code's file to ``"<dynamic-code>"``, so a
worker's traceback would say ``File "<dynamic-code>", line 7`` and show no source. The
pickler here keeps each code object's real file name, and the payload carries the
source lines of files a worker cannot read (notebook cells live only in the kernel's
``linecache``); :func:`load_job` registers them there, so worker tracebacks show the
user's file, line and code.
"""

from __future__ import annotations

import io
import linecache
import os
import pickle
import types
from typing import Any, Dict, List

import cloudpickle

_DYNAMIC = "<dynamic-code>"


class _SourcePickler(cloudpickle.Pickler):
    """cloudpickle, but code objects keep ``co_filename``; remembers those files."""

    def __init__(self, file, files: set):
        super().__init__(file)
        self._files = files

    def reducer_override(self, obj):
        if type(obj) is types.CodeType:  # before the dispatch table, which renames the file
            return self._reduce_code(obj)
        return super().reducer_override(obj)

    def _reduce_code(self, code: types.CodeType):
        factory, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
        if _DYNAMIC not in args:  # cloudpickle changed its layout: keep its behaviour
            return factory, args
        self._files.add(code.co_filename)
        return factory, tuple(code.co_filename if a == _DYNAMIC else a for a in args)


def _sources(files: set) -> Dict[str, List[str]]:
    """Lines of the files that exist only in this process's linecache (notebook cells)."""
    found = {}
    for name in files:
        if os.path.isfile(name):
            continue  # the worker reads it from disk, like any module
        lines = linecache.getlines(name)
        if lines:
            found[name] = lines
    return found


def dump_job(job: Any) -> bytes:
    """Pickles ``job`` (cloudpickle, by value where needed) with its sources."""
    buffer, files = io.BytesIO(), set()
    _SourcePickler(buffer, files).dump(job)
    return pickle.dumps({"sources": _sources(files), "job": buffer.getvalue()})


def load_job(blob: bytes) -> Any:
    """Registers the shipped sources in ``linecache`` and unpickles the job."""
    outer = pickle.loads(blob)
    for name, lines in outer["sources"].items():
        # mtime None: linecache.checkcache() leaves the entry alone (as IPython's cells).
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
    return cloudpickle.loads(outer["job"])
