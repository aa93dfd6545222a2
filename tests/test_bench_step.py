"""`bench step` on the tiny model: every phase is timed and the table is complete."""

from labkit.bench import step as bench_step
from tests.bench_helpers import json_rows, refuses


def test_step_rows_have_every_phase(capsys):
    rows, _ = json_rows(bench_step.main, ["--model", "tiny", "--batch", "1,3", "--context", "8",
                                          "--steps", "2", "--json"], capsys)
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert set(r["phases_ms"]) == set(bench_step.PHASES)
        assert r["engine_step_ms"] > 0 and r["bare_forward_ms"] > 0
        assert r["phases_ms"]["kv write + attention"] > 0 and r["phases_ms"]["mlp"] > 0


def test_a_quantized_step_times_its_fused_projections(capsys):
    # a quantized model runs with q|k|v and gate|up fused, and its head is a QuantLinear
    rows, _ = json_rows(bench_step.main, ["--model", "tiny", "--batch", "2", "--context", "8",
                                          "--steps", "2", "--quant", "int8", "--json"], capsys)
    phases = rows[0]["phases_ms"]
    assert phases["qkvo proj"] > 0 and phases["mlp"] > 0 and phases["head"] > 0


def test_bad_batch_exits_2(capsys, monkeypatch):
    refuses(bench_step.main, ["--batch", "0"], "--batch, --context and --steps must be >= 1",
            capsys, monkeypatch)


def test_bad_quant_exits_2(capsys, monkeypatch):
    refuses(bench_step.main, ["--quant", "int5"], "--quant", capsys, monkeypatch)
