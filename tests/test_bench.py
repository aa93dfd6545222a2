"""`python -m labkit bench`: the benchmarks run and report what they document (no timing
assertions: a benchmark measures, a test checks)."""

import json
import subprocess
import sys

import pytest

from labkit import bench


@pytest.mark.slow
def test_bench_generate_quick_json_reports_the_documented_fields():
    proc = subprocess.run([sys.executable, "-m", "labkit", "bench", "generate", "--quick",
                           "--json", "--threads", "1"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)  # exactly one JSON object on stdout; progress on stderr
    for key in ("labkit_tok_s", "hf_tok_s", "ratio", "hf_grouped_tok_s", "hf_padded_tok_s"):
        assert isinstance(res[key], float) and res[key] > 0, (key, res[key])
    assert res["ratio"] == pytest.approx(res["labkit_tok_s"] / res["hf_tok_s"])
    assert res["hf_tok_s"] == max(res["hf_grouped_tok_s"], res["hf_padded_tok_s"])
    assert res["streams"] == 8 and res["threads"] == 1
    # 8 requests with max_new_tokens cycling through QUICK_LENGTHS, each run to its length
    assert res["tokens"] == sum(bench.QUICK_LENGTHS[i % len(bench.QUICK_LENGTHS)]
                                for i in range(8))


def test_workload_is_32_chat_prompts_with_varied_lengths():
    assert len(bench.INSTRUCTIONS) == 32 == len(set(bench.INSTRUCTIONS))
    lengths = [bench.OUTPUT_LENGTHS[i % len(bench.OUTPUT_LENGTHS)] for i in range(32)]
    assert min(lengths) == 16 and max(lengths) == 96


def test_left_padding_puts_prompts_at_the_right_edge():
    ids, mask = bench._left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_unknown_benchmark_exits_2(capsys):
    assert bench.main(["nosuch"]) == 2
    assert "unknown benchmark 'nosuch'" in capsys.readouterr().err
    assert bench.main([]) == 0 and "generate" in capsys.readouterr().out
