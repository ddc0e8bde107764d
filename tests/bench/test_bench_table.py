"""Bounds math, size parsing, timing reduction and table formatting (no processes)."""

from __future__ import annotations

import pytest

from bpstrain.bench import bounds
from bpstrain.bench._report import Case, emit, format_case, parse_cases, parse_result, time_calls
from bpstrain.bench.cluster import ClusterPlan
from bpstrain.bench.table import Row, attach_gloo, format_table, format_time, reduce_times

MB = 1 << 20


@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("4K", 4096), ("4KiB", 4096), ("64M", 64 * MB), ("64mb", 64 * MB),
    ("1G", 1 << 30), ("1.5M", 3 * MB // 2), (256, 256),
])
def test_parse_size(text, expected):
    assert bounds.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "4X", "-1M", "M", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="Received"):
        bounds.parse_size(text)


def test_format_size_round_trips_binary_units():
    assert [bounds.format_size(n) for n in (4096, 64 * MB, 1 << 30, 1000, 1536)] == [
        "4K", "64M", "1G", "1000", "1.5K"]


def test_ps_bound_is_link_bound_with_enough_servers():
    link = bounds.link_bytes_per_s(800)  # 100 MB/s
    assert link == 100e6
    assert bounds.ps_bound_s(100_000_000, workers=2, servers=2, link_bps=link) == 1.0
    assert bounds.ps_bound_s(100_000_000, workers=4, servers=8, link_bps=link) == 1.0


def test_ps_bound_is_server_bound_with_few_servers():
    link = 100e6
    assert bounds.ps_bound_s(100_000_000, workers=4, servers=1, link_bps=link) == 4.0
    assert bounds.ps_bound_s(100_000_000, workers=4, servers=2, link_bps=link) == 2.0


def test_ring_bound():
    link = 100e6
    assert bounds.ring_bound_s(100_000_000, 1, link) == 0.0
    assert bounds.ring_bound_s(100_000_000, 2, link) == 1.0
    assert bounds.ring_bound_s(100_000_000, 4, link) == 1.5


def test_bounds_reject_nonsense():
    with pytest.raises(ValueError, match="Received"):
        bounds.ps_bound_s(1, workers=2, servers=0, link_bps=1.0)
    with pytest.raises(ValueError, match="Received"):
        bounds.ring_bound_s(1, workers=0, link_bps=1.0)


def test_cases_round_trip_and_validation():
    cases = parse_cases(["4096:10", "64:3:2"])
    assert cases == [Case(4096, 10, 1), Case(64, 3, 2)]
    assert parse_cases([format_case(c) for c in cases]) == cases
    for bad in ("4096", "6:1", "4096:0", "a:b"):
        with pytest.raises(ValueError, match="Received"):
            parse_cases([bad])


def test_time_calls_skips_warmup_and_resets_each_time():
    calls = []
    times = time_calls(lambda: calls.append("fn"), Case(4, iters=3, warmup=2),
                       reset=lambda: calls.append("reset"))
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert calls == ["reset", "fn"] * 5


def test_result_line_survives_other_output(capsys):
    print("engine: hello")
    emit("gloo", 1, 2, [{"bytes": 4, "times": [0.5]}])
    print("engine: bye")
    payload = parse_result(capsys.readouterr().out)
    assert payload == {"system": "gloo", "rank": 1, "size": 2,
                       "results": [{"bytes": 4, "times": [0.5]}]}
    with pytest.raises(ValueError, match="Received"):
        parse_result("no result here")


def test_reduce_times_takes_median_of_slowest_rank():
    payloads = [
        {"results": [{"bytes": 8, "times": [1.0, 5.0, 2.0]}]},
        {"results": [{"bytes": 8, "times": [3.0, 1.0, 2.5]}]},
    ]
    # Slowest per iteration: 3.0, 5.0, 2.5 -> median 3.0.
    assert reduce_times(payloads) == {8: 3.0}
    with pytest.raises(ValueError, match="Received"):
        reduce_times([payloads[0], {"results": [{"bytes": 8, "times": [1.0]}]}])


def test_table_columns():
    link = 100e6
    rows = [
        Row("bpstrain", 2, 2, 100_000_000, 2.0, partition_bytes=4 * MB, link_bps=link,
            bound_s=bounds.ps_bound_s(100_000_000, 2, 2, link)),
        Row("gloo", 2, None, 100_000_000, 1.25, link_bps=link,
            bound_s=bounds.ring_bound_s(100_000_000, 2, link)),
        Row("bpstrain", 2, 2, 4096, 0.0004),
    ]
    attach_gloo(rows)
    text = format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["system", "n", "k", "size", "part"]
    assert set(lines[1]) == {"-"}
    bps = lines[2].split()
    # 100 MB in 2 s = 0.4 Gbit/s = 0.5 of the link = 0.5 of the bound; gloo 1.6x faster.
    assert bps[:5] == ["bpstrain", "2", "2", "95.4M", "4M"]
    assert bps[5:] == ["2.00", "s", "0.400", "0.50", "1.00", "s", "0.50", "0.62x"]
    assert lines[3].split()[-1] == "1.00x"
    assert lines[4].split()[-4:] == ["-", "-", "-", "-"]
    assert rows[0].as_dict()["vs_gloo"] == pytest.approx(0.625)


def test_format_time_units():
    assert [format_time(t) for t in (0.000123, 0.0456, 2.5)] == ["123 us", "45.6 ms", "2.50 s"]


def test_cluster_plan_layout_and_validation():
    plan = ClusterPlan(workers=(2, 4), servers=(1, 2, 4), sizes=(4 * MB,), rate_mbit=800)
    assert plan.num_hosts == 9
    assert ClusterPlan(workers=(2,), servers=(1,), scheduler="host0").num_hosts == 3
    assert [c.nbytes for c in ClusterPlan(sizes=(MB, 4 * MB)).cases()] == [4 * MB, MB]
    assert plan.timeout_s(4, 1) > 120
    with pytest.raises(ValueError, match="Received"):
        ClusterPlan(scheduler="elsewhere")
