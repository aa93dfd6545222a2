"""`bench paged`: argument checks, and a short run of the three policies on the tiny model."""

import pytest

from labkit.bench import paged as bench_paged
from tests.bench_helpers import json_rows, refuses


@pytest.mark.parametrize("argv, words", [
    (["--kv-tokens", "0"], "--kv-tokens must be >= 1"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--max-new", "0"], "--max-new must be >= 1"),
    (["--policies", "buddy"], "unknown ['buddy']"),
    (["--scale", "0"], "--scale must be in (0, 1]"),
    (["--kv-tokens", "100"], "cannot hold one request"),
])
def test_bad_values_exit_2_before_loading(argv, words, capsys, monkeypatch):
    refuses(bench_paged.main, argv, words, capsys, monkeypatch)


def test_on_demand_runs_three_times_the_sequences_of_contiguous(capsys):
    rows, _ = json_rows(bench_paged.main, ["--model", "tiny", "--requests", "24", "--scale",
                                           "0.1", "--kv-tokens", "512", "--block-size", "4",
                                           "--json"], capsys)
    rows = {r["policy"]: r for r in rows}
    assert set(rows) == {"contiguous", "reserve", "on_demand"}
    assert len({r["kv_bytes"] for r in rows.values()}) == 1  # equal memory
    assert rows["on_demand"]["max_concurrent"] >= 3 * rows["contiguous"]["max_concurrent"]
    assert rows["on_demand"]["internal_waste_pct"] < rows["contiguous"]["internal_waste_pct"]
