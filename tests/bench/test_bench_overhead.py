"""The per-operation overhead benchmark runs end to end and prints its table.

Only the table is checked, not the ratios: timings on a shared 2-core CI machine are
too noisy for a threshold.
"""

from __future__ import annotations

import pytest

from bpstrain.bench import overhead
from bpstrain.bench.cli import main


@pytest.mark.timeout(180)
def test_overhead_bench_prints_one_row_per_path(capsys):
    assert main(["overhead", "--ops", "100", "--blocks", "3", "--warmup", "20",
                 "--timeout", "120"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("per-op cost, 1K float32 sum, 2 workers") and "torch/raw = " in lines[0]
    assert lines[1].split() == ["path", "us/op", "vs", "raw"]
    rows = [line.rsplit(None, 2) for line in lines[3:]]
    assert [r[0] for r in rows] == ["raw binding", "bpstrain.engine", "bpstrain.torch"]
    assert rows[0][2] == "1.00x" and all(float(r[1]) > 0 for r in rows)


def test_rows_take_the_median_block_of_the_slowest_rank():
    payloads = [{"results": [{"path": p, "times": times} for p in overhead.PATHS]}
                for times in ([1e-6, 5e-6, 3e-6], [2e-6, 1e-6, 3e-6])]
    rows = overhead.rows_from(payloads)
    assert [round(r.per_op_s * 1e6, 3) for r in rows] == [3.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="Received: bytes=3"):
        overhead.OverheadPlan(nbytes=3)
