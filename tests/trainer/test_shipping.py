"""Worker tracebacks name the user's file and line for classes shipped by value."""

import linecache
import traceback

import pytest

from bpstrain.launch import free_port
from bpstrain.trainer import Trainer
from bpstrain.trainer._shipping import dump_job, load_job
from tests.trainer.helpers import base_config, blobs

CELL = "/nonexistent/ipykernel_0/cell-7.py"  # like a notebook cell: only in linecache
SOURCE = '''\
from tests.trainer.helpers import StepModule


class CellModule(StepModule):
    def training_step(self, batch, batch_idx):
        raise ValueError("bug in the cell")


def broken():
    return 1 / 0
'''


def _define_in_cell():
    """Runs SOURCE the way a kernel runs a cell: compiled under CELL, source in linecache."""
    linecache.cache[CELL] = (len(SOURCE), None, SOURCE.splitlines(True), CELL)
    namespace = {"__name__": "__main__"}  # not importable: cloudpickle ships it by value
    exec(compile(SOURCE, CELL, "exec"), namespace)
    return namespace


@pytest.mark.timeout(30)
def test_shipped_code_keeps_its_file_and_source():
    broken = _define_in_cell()["broken"]
    blob = dump_job(broken)
    del linecache.cache[CELL]  # a fresh worker has never seen the cell
    shipped = load_job(blob)
    with pytest.raises(ZeroDivisionError):
        shipped()
    try:
        shipped()
    except ZeroDivisionError:
        text = traceback.format_exc()
    assert f'File "{CELL}", line 10, in broken' in text and "return 1 / 0" in text
    assert "<dynamic-code>" not in text


@pytest.mark.timeout(120)
def test_worker_traceback_shows_the_notebook_cell(tmp_path):
    module = _define_in_cell()["CellModule"]()
    cfg = base_config(tmp_path, **{"cluster.workers": 2, "cluster.port": free_port()})
    with pytest.raises(ValueError, match="bug in the cell") as info:
        Trainer(cfg).fit(module, blobs(128))
    text = info.value.remote_traceback
    assert f'File "{CELL}", line 6, in training_step' in text
    assert 'raise ValueError("bug in the cell")' in text and "<dynamic-code>" not in text
