"""`bench serve`: argument checks, and a short run of every setting on the tiny model."""

import pytest

from labkit import bench_serve
from tests.bench_helpers import json_rows, refuses


@pytest.mark.parametrize("argv, words", [
    (["--rate", "0"], "--rate must be > 0"), (["--rate", "-1"], "--rate must be > 0"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--max-step-tokens", "0"], "--max-step-tokens must be >= 1"),
    (["--batching", "dynamic"], "--batching must be static or continuous"),
])
def test_bad_values_exit_2_before_loading(argv, words, capsys, monkeypatch):
    refuses(bench_serve.main, argv, words, capsys, monkeypatch)


def test_settings_parse_as_sweeps():
    a = bench_serve.parse_args(["--rate", "1,4", "--max-step-tokens", "32,none",
                                "--batching", "continuous"])
    assert a.rate == [1.0, 4.0] and a.max_step_tokens == [32, None]
    assert a.batching == ["continuous"]


def test_tiny_run_writes_one_row_per_setting(capsys):
    rows, err = json_rows(bench_serve.main, [
        "--model", "tiny", "--rate", "50", "--requests", "6", "--short", "--max-step-tokens",
        "16", "--batching", "static,continuous", "--decoder", "blocking", "--json"], capsys)
    assert [r["batching"] for r in rows] == ["static", "continuous"]
    keys = {"batching", "rate", "requests", "max_step_tokens", "throughput_tok_s", "ttft_p50_ms",
            "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "goodput"}
    for r in rows:
        assert keys <= set(r) and r["requests"] == 6 and r["max_step_tokens"] == 16
        assert r["throughput_tok_s"] > 0 and 0 <= r["goodput"] <= 1
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"]
    assert "round 1/1" in err  # progress on stderr
