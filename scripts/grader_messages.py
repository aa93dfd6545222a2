"""What the graders print for the mistakes learners make: docs/grader_messages.md, which
docs/instructors.md links to. Regenerate it; never type it.

    .venv/bin/python scripts/grader_messages.py [--out docs/grader_messages.md]

For each exercise, two or three of the wrong answers that the tests hold its grader to
(tests/test_graders_reject.py and the chapters' grader tests: the chapter's own bug first) go
through `check.grade_line`, the function behind `make grade` and every notebook's check cell,
and the line it returns is written down as it is printed. A wrong answer that a grader passes
stops the script: that is a defect of the grader (STYLE rule 16), not a line for the guide.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the wrong answers live in tests/
    sys.path.insert(0, str(ROOT))


def picks() -> list[tuple[str, str, object]]:
    """(exercise, the mistake in words, the wrong answer), in `make grade`'s order."""
    from labkit.decode_blocking import run_blocking
    from tests import test_ch04_graders as t04
    from tests import test_grader_ch03 as t03
    from tests import test_graders_ch02_ch05 as t25
    from tests import test_graders_ch08 as t08
    from tests import test_graders_reject as r

    w = r.WRONG
    return [
        ("rms_norm", "eps added outside the square root", w["rms_norm"][0][0]),
        ("rms_norm", "LayerNorm (subtracts the mean)", w["rms_norm"][3][0]),
        ("rms_norm", "the `weight` scale left out", w["rms_norm"][4][0]),
        ("top_p_filter", "the nucleus found in sorted order but not scattered back",
         w["top_p_filter"][1][0]),
        ("top_p_filter", "the token that crosses p dropped (mass carried past p)",
         w["top_p_filter"][3][0]),
        ("top_p_filter", "dropped tokens set to 0 instead of -inf", w["top_p_filter"][4][0]),
        ("matmul_intensity", "integer division", w["matmul_intensity"][0][0]),
        ("matmul_intensity", "one FLOP per multiply-add", w["matmul_intensity"][1][0]),
        ("matmul_intensity", "the write of C not counted", w["matmul_intensity"][3][0]),
        ("decode_step_flops", "k and v with num_heads (GQA ignored)",
         w["decode_step_flops"][0][0]),
        ("decode_step_flops", "two MLP matrices instead of three", w["decode_step_flops"][1][0]),
        ("decode_step_flops", "the output head left out", w["decode_step_flops"][3][0]),
        ("decode_step_bytes", "KV counted in weight_bytes", w["decode_step_bytes"][0][0]),
        ("decode_step_bytes", "KV with num_heads (GQA ignored)", w["decode_step_bytes"][2][0]),
        ("decode_step_bytes", "the KV cache not counted at all", w["decode_step_bytes"][4][0]),
        ("admit_fcfs", "`<` where the last page fits (off by one)", t25.admit_strict),
        ("admit_fcfs", "a later, smaller request jumps the queue", t25.admit_jumping),
        ("admit_fcfs", "slots not checked", r.ch02_admit_ignores_slots),
        ("chunk_prefills", "prefill first: decode starved", t25.chunks_prefill_first),
        ("chunk_prefills", "one token over the budget", t25.chunks_over_by_one),
        ("chunk_prefills", "decode rows not counted against the budget",
         r.ch02_chunks_whole_budget),
        ("latency_percentiles", "TPOT percentiles over tokens, not requests",
         t25.percentiles_over_tokens),
        ("latency_percentiles", "TPOT that includes the first token",
         t25.percentiles_tpot_with_ttft),
        ("quantize_int8", "one scale for the whole tensor", t03.per_tensor_int8),
        ("quantize_int8", "clamped to -128 with a symmetric scale", t03.minus_128_int8),
        ("quantize_int8", "truncated instead of rounded", t03.truncating_int8),
        ("dequantize_int8", "one scale for the whole tensor", t03.per_tensor_dequant),
        ("pack_int4", "high nibble first", t03.swapped_pack),
        ("unpack_int4", "high nibble first", t03.swapped_unpack),
        ("awq_scale", "no search (s = 1: plain RTN)", t03.rtn_only_awq),
        ("awq_scale", "scores the weights' error, not the outputs'", r._awq_search(r._weight_err)),
        ("awq_scale", "keeps the largest error", r._awq_search(r._out_err, pick=max)),
        ("online_softmax_update", "no rescale when the max rises (the chapter's bug)",
         t04.no_rescale),
        ("online_softmax_update", "the max of this tile only", t04.max_of_tile_only),
        ("online_softmax_update", "m = 0 returned for an all-masked row", t04.safe_zero_max),
        ("merge_partials", "a plain average of the two parts", t04.plain_average),
        ("merge_partials", "weights exp(lse_i) (overflow)", t04.weighed_by_exp_lse),
        ("tiled_attention", "causal limit one key too far", t04.tiles(+1)),
        ("tiled_attention", "the whole score matrix built", t04.whole_matrix),
        ("tiled_attention", "tiles, but a [Tq, L] mask built first", t04.tiles_with_whole_mask),
        ("blocks_needed", "n // bs + 1 (wrong at exact multiples)", lambda n, bs: n // bs + 1),
        ("blocks_needed", "rounds down", lambda n, bs: n // bs),
        ("translate", "// and % swapped", r.ch05_translate_swapped),
        ("translate", "the page id not multiplied by block_size",
         lambda t, pos, bs: t[pos // bs] + pos % bs),
        ("translate", "a negative position accepted (table[-1])",
         r.ch05_translate_no_negative_check),
        ("CowPages", "free returns a page that others still hold", t25.FreesShared),
        ("CowPages", "no copy on write", t25.NoCopyOnWrite),
        ("CowPages", "a double free goes unnoticed", t25.NoDoubleFreeCheck),
        ("bubble_fraction", "overlapping spans counted twice", r.summed),
        ("bubble_fraction", "the busy share instead of the idle share",
         w["bubble_fraction"][1][0]),
        ("bubble_fraction", "the window taken from the spans, not t0..t1", r.first_to_last),
        ("cost_model", "n periods for n launches", w["cost_model"][0][0]),
        ("cost_model", "T_host + T_device as the blocking step (round trips dropped)",
         w["cost_model"][3][0]),
        ("cost_model", "divided by min(T_host, T_device)", w["cost_model"][4][0]),
        ("commit_row", "inflight_refs set to 0 (the chapter's bug)", r.refs_zeroed),
        ("commit_row", "no decrement for a zombie row", r.no_decrement_for_zombies),
        ("commit_row", "a zombie's token appended", r.zombie_appends),
        ("can_release", "released at finalized (the zombie still in flight)",
         w["can_release"][0][0]),
        ("can_release", "released before finalized", w["can_release"][1][0]),
        ("can_release", "released twice", w["can_release"][2][0]),
        ("run_pipelined", "the blocking loop handed in", run_blocking),
        ("run_pipelined", "one slot for every step", r.pipelined_with(slot_of=lambda prev: 0)),
        ("run_pipelined", "sampled before the commit", r.pipelined_with(sample_first=True)),
        ("predict_wall", "the pipelined loop adds instead of overlapping", t08.wall_always_adds),
        ("predict_wall", "the blocking loop overlaps", t08.wall_always_overlaps),
        ("predict_wall", "fixed_scale ignored", t08.wall_no_scale),
        ("relay", "asks about the client only when nothing came", t08.relay_checks_only_when_idle),
        ("relay", "cancels after the request finished (double free)",
         t08.relay_cancels_at_the_end),
        ("relay", "never cancels", t08.relay_never_cancels),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "grader_messages.md")
    args = p.parse_args(argv)
    import torch

    from labkit.graders import check

    torch.set_num_threads(1)  # as the test suite grades
    out = ["# What the graders print for common mistakes",
           "",
           "Written by `scripts/grader_messages.py`; do not edit by hand. Each wrong answer is "
           "one of those the tests hold the grader to (tests/test_graders_reject.py and the "
           "chapters' grader tests), graded by `check.grade_line`, the function behind "
           "`make grade` and every notebook's check cell; the line is what a learner sees.",
           ""]
    module = None
    t0 = time.perf_counter()
    for name, mistake, wrong in picks():
        line = check.grade_line(name, wrong)
        if not line.startswith("✗"):
            raise SystemExit(f"{name}: the grader passed a wrong answer ({mistake}): {line}")
        if check.EXERCISES[name].module != module:
            module = check.EXERCISES[name].module
            out += [f"## exercises/{module}.py", ""]
        out += [f"- `{name}`, {mistake}:", "", "  ```text", f"  {line}", "  ```", ""]
        print(f"{name}: {mistake}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(out))
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
