"""`bench serve`: argument checks, and a short run of every setting on the tiny model."""

import time

import pytest

from labkit.bench import serve as bench_serve
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


def test_engine_step_is_the_time_of_one_launch():
    # a model that sleeps 5 ms per forward: every launch costs at least that, and the median
    # launch not much more (the tiny model's own forward is well under a millisecond)
    from labkit.loading import load_model

    model, _ = load_model("tiny")
    forward = model.forward

    def slow(*a, **kw):
        time.sleep(0.005)
        return forward(*a, **kw)

    model.forward = slow
    try:
        step = bench_serve.engine_step_s(model, batch=2, steps=6, repeats=1)
    finally:
        del model.forward
    assert 0.005 <= step < 0.05, step


def test_engine_step_checks_its_arguments():
    with pytest.raises(ValueError, match="must be >= 1"):
        bench_serve.engine_step_s(None, batch=0)
