"""Worker script of the tests/torch multi-process jobs.

    python -m bpstrain.launch --workers 2 --servers 1 -- \
        python tests/torch/torch_check_worker.py torch_checks_api torch_checks_training

Runs every ``check_*`` function of the named modules (in source order, the same on
every rank) and prints one ``CHECK {"name", "rank", "ok", "error", "value"}`` line per
check (``value``: what the check returned, for tests that compare jobs), so one launch
reports many results. A failing check does not stop the others; the op
timeout (BPSTRAIN_OP_TIMEOUT, set by the tests) bounds any wait it leaves behind.
"""

import importlib
import inspect
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bpstrain.torch as bps  # noqa: E402
from bpstrain import engine  # noqa: E402


def collect(module_names):
    """(qualified name, function) of every check_* function, in source order."""
    checks = []
    for module_name in module_names:
        module = importlib.import_module(module_name)
        funcs = [f for n, f in vars(module).items() if n.startswith("check_") and callable(f)]
        funcs.sort(key=lambda f: inspect.getsourcelines(f)[1])
        checks += [(f.__name__, f) for f in funcs]
    # Checks of error paths last: if the engine itself fails there, the others still ran.
    return sorted(checks, key=lambda item: "mismatch" in item[0] or "raises" in item[0])


def main(argv):
    bps.init()
    for name, func in collect(argv):
        try:
            value = func()
            result = {"ok": True, "error": "", "value": value}
        except BaseException as exc:  # report and go on with the next check
            result = {"ok": False, "error": "".join(traceback.format_exception(exc))[-3000:]}
        result.update(name=name, rank=bps.rank())
        print("CHECK " + json.dumps(result), flush=True)
        engine.barrier()
    bps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
