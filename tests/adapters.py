"""The one switch between labkit's solutions and a learner's exercises.

Every grader in tests/test_exercises.py calls only these functions. With `LABKIT_EXERCISES=1`
they call the stubs in `exercises/`; otherwise labkit's own solutions, which must pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from labkit.graders import check

USE_EXERCISES = os.environ.get("LABKIT_EXERCISES") == "1"


ROOT = Path(__file__).resolve().parent.parent  # this clone: its exercises/, not another's


def pick(module: str, name: str, solution: Callable) -> Callable:
    """The learner's `exercises/<module>.py::<name>` when grading exercises, else `solution`."""
    if USE_EXERCISES:
        return getattr(check.load_exercises(module, ROOT), name)
    return solution


def stub(module: str, name: str) -> Callable:
    """The untouched stub, for the test that checks stubs fail with a helpful message."""
    return getattr(check.load_exercises(module, ROOT), name)


def solutions() -> dict[str, Callable]:
    """Exercise name -> the function the graders check (learner's or labkit's)."""
    from labkit import (
        attention,
        awq,
        decode_pipelined,
        model,
        paged_kv,
        quant,
        roofline,
        sampling,
        sequence,
        speculative,
    )
    from labkit.bench import ablation as bench_ablation
    from labkit.bench import decode as bench_decode
    from labkit.instruments import kv_sim, serve_sim, timeline
    from labkit.serving import metrics, server

    return {
        # chapter 00
        "rms_norm": pick("ch00_welcome", "rms_norm", model.rms_norm),
        "top_p_filter": pick("ch00_welcome", "top_p_filter", sampling.top_p_filter),
        # later chapters add their exercises below, one line each
        # chapter 01
        "matmul_intensity": pick("ch01_roofline", "matmul_intensity", roofline.matmul_intensity),
        "decode_step_flops": pick("ch01_roofline", "decode_step_flops",
                                  roofline.decode_step_flops),
        "decode_step_bytes": pick("ch01_roofline", "decode_step_bytes",
                                  roofline.decode_step_bytes),
        # chapter 03
        "quantize_int8": pick("ch03_quantization", "quantize_int8", quant.quantize_int8),
        "dequantize_int8": pick("ch03_quantization", "dequantize_int8", quant.dequantize_int8),
        "pack_int4": pick("ch03_quantization", "pack_int4", quant.pack_int4),
        "unpack_int4": pick("ch03_quantization", "unpack_int4", quant.unpack_int4),
        "awq_scale": pick("ch03_quantization", "awq_scale", awq.awq_scale),
        # chapter 04
        "online_softmax_update": pick("ch04_flash_attention", "online_softmax_update",
                                      attention.online_softmax_update),
        "merge_partials": pick("ch04_flash_attention", "merge_partials",
                               attention.merge_partials),
        "tiled_attention": pick("ch04_flash_attention", "tiled_attention",
                                attention.flash_attention),
        # chapter 07
        "commit_row": pick("ch07_pipelined", "commit_row", sequence.commit_row),
        "can_release": pick("ch07_pipelined", "can_release", sequence.can_release),
        "run_pipelined": pick("ch07_pipelined", "run_pipelined",
                              decode_pipelined.run_pipelined),
        # chapter 02
        "admit_fcfs": pick("ch02_batching", "admit_fcfs", serve_sim.admit_fcfs),
        "chunk_prefills": pick("ch02_batching", "chunk_prefills", serve_sim.chunk_prefills),
        "latency_percentiles": pick("ch02_batching", "latency_percentiles",
                                    metrics.latency_percentiles),
        # chapter 05
        "blocks_needed": pick("ch05_paged_attention", "blocks_needed", paged_kv.blocks_needed),
        "translate": pick("ch05_paged_attention", "translate", kv_sim.translate),
        "CowPages": pick("ch05_paged_attention", "CowPages", kv_sim.CowPages),
        # chapter 06
        "bubble_fraction": pick("ch06_gpu_bubble", "bubble_fraction", timeline.idle_fraction),
        "cost_model": pick("ch06_gpu_bubble", "cost_model", bench_decode.cost_model),
        # chapter 08
        "predict_wall": pick("ch08_capstone", "predict_wall", bench_ablation.predict_wall),
        "relay": pick("ch08_capstone", "relay", server.relay),
        # chapter 09
        "expected_tokens": pick("ch09_speculative", "expected_tokens",
                                speculative.expected_tokens),
        "accept_greedy": pick("ch09_speculative", "accept_greedy", speculative.accept_greedy),
        "accept_sampled": pick("ch09_speculative", "accept_sampled",
                               speculative.accept_sampled),
        "rollback": pick("ch09_speculative", "rollback", speculative.rollback),
    }
