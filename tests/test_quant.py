"""Weight-only quantization: the codes, the packed kernels against the dequantize reference,
the AWQ fold, the model cache round trip, and quantized engines on both decoders."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from labkit.awq import apply_awq, quantize_awq, search_scale
from labkit.decoders import run
from labkit.kernels import cpu as cpu_kernels
from labkit.loading import load_model
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.perplexity import CausalAttention
from labkit.quant import (
    QuantLinear,
    QuantScheme,
    dequantize_int4,
    dequantize_int8,
    load_quantized,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantize_model,
    quantized_state,
    relayout,
    unpack_int4,
    untie_head,
)

SCHEMES = ["int8", "int4-g32", "int4-g64", "int4-g128"]


def ref_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8, written out: scale = max|row| / 127, round, clamp to +-127."""
    scale = w.abs().amax(dim=1) / 127
    return torch.clamp(torch.round(w / scale[:, None]), -127, 127), scale


def test_int8_codes_match_the_reference():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    q, s = quantize_int8(w)
    q_ref, s_ref = ref_int8(w)
    assert q.dtype == torch.int8 and int(q.min()) >= -127, "int8 codes stay in [-127, 127]"
    assert torch.equal(q.float(), q_ref) and torch.allclose(s, s_ref, rtol=1e-6)


@pytest.mark.parametrize("group", [32, 64])
def test_int4_rounds_to_the_nearest_level(group):
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    q, s, z = quantize_int4(w, group)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    err = (dequantize_int4(q, s, z) - w).abs().reshape(16, -1, group)  # [N, G, g]
    # round to nearest: no weight is more than half a step from its level (fp32 slack)
    assert bool((err <= s[..., None] / 2 + 1e-6).all()), "RTN puts every weight within s/2"


def test_pack_int4_round_trips_and_puts_even_columns_low():
    q = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(2),
                      dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (8, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert int(pack_int4(torch.tensor([[3, 12]], dtype=torch.uint8))) == 0xC3  # low nibble first


@pytest.mark.parametrize("spec", SCHEMES)
def test_packed_kernel_layout_holds_the_codes(spec):
    # the kernel times the identity reads back each weight: its packed layout lost nothing
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(3))
    ql = QuantLinear.from_weight(w, QuantScheme.parse(spec))
    got = ql(torch.eye(128)).t()  # [N, K]
    want = ql.dequantized()
    # labkit's kernels sum in fp32: exact (int4: cpu_kernels.int4_layout, or int4_dot_layout,
    # whose int16 activations hold the identity's 0s and 1s exactly, with exact products);
    # int8 on the integer dot product holds a 1 as 32639 codes times a scale of 1 / 32639,
    # which fp32 rounds: within a few roundings, where a lost or misplaced code would be off
    # by at least a step (a 127th of the row's largest weight)
    labkits = cpu_kernels.kernels() is not None and ql._labkit_kernel is not None
    if not labkits:  # torch's kernels output bf16
        want = want.bfloat16().float()
    if labkits and ql.scheme.bits == 8 and cpu_kernels.kernels().has_int8_dot():
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        q, scale, _ = ql.canonical()
        off = q.clone()
        off[5, 7] += 1 if off[5, 7] < 127 else -1
        with pytest.raises(AssertionError):  # (the check sees one code off by one)
            torch.testing.assert_close(got, dequantize_int8(off, scale), rtol=1e-6, atol=0)
    else:
        assert torch.equal(got, want), f"{spec}: packed weights differ from the codes"


@pytest.mark.parametrize("dot", ["1", "0"])
def test_an_int8_linear_on_labkits_layout_holds_only_it_and_gives_the_codes_back(
        monkeypatch, dot):
    # where the CPU has the integer dot product, int8 codes are held in labkit's layout alone
    # (cpu_kernels.int8_dot_layout); LABKIT_INT8_DOT=0 keeps them as they are
    monkeypatch.setenv("LABKIT_INT8_DOT", dot)
    w = torch.randn(100, 128, generator=torch.Generator().manual_seed(8))  # 6 blocks of 16 + 4
    q, s = quantize_int8(w, bf16_scales=True)
    ql = QuantLinear(128, 100, QuantScheme.parse("int8"))
    ql.set_codes(q, s)
    built = cpu_kernels.kernels()
    if dot == "0" or built is None or not built.has_int8_dot():
        assert ql._labkit_kernel == "int8_linear"  # (torch's kernel where none is built)
        assert torch.equal(ql.qweight, q) and "qweight" in ql.state_dict()
        return
    assert ql._labkit_kernel == "int8_linear_dot"
    assert {n for n, _ in ql.named_buffers()} == {"kweight", "kscale"}
    assert ql.kweight.shape == (7, 2, 1024)  # the last block's 12 rows past N hold 0 (as 128)
    assert (ql.kweight[6].view(2, 16, 16, 4)[:, :, 4:] == 128).all()
    state = ql.state_dict()
    assert torch.equal(state["qweight"], q) and torch.equal(state["scale"], s)
    assert "zero" not in state and torch.equal(ql.canonical()[0], q)
    assert torch.equal(ql.dequantized(), dequantize_int8(q, s))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(9))
    before = ql(x)
    monkeypatch.setenv("LABKIT_INT8_DOT", "0")  # the same codes as they are: the same bits
    rows = QuantLinear(128, 100, QuantScheme.parse("int8"))
    rows.set_codes(state["qweight"], state["scale"])
    # (under a torch mode, the tests' fake CUDA, torch's ops serve both: other roundings)
    served = cpu_kernels.usable(x) is not None
    assert rows._labkit_kernel == "int8_linear" and (not served or torch.equal(rows(x), before))
    monkeypatch.setenv("LABKIT_INT8_DOT", "1")
    relayout(ql)  # as after a move: the codes recovered from the layout, the layout rebuilt
    assert torch.equal(ql(x), before) and ql._labkit_kernel == "int8_linear_dot"


@pytest.mark.parametrize("int4_dot", ["1", "0"])
def test_an_int4_linear_on_labkits_layout_holds_only_it_and_gives_the_codes_back(
        monkeypatch, int4_dot):
    # labkit's int4 layouts are exact: such a linear keeps no canonical copy, and what it
    # gives back for the cache, the reference and a move is exactly what it was given
    monkeypatch.setenv("LABKIT_INT4_DOT", int4_dot)
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(8))
    q, s, z = quantize_int4(w, 32, bf16_scales=True)
    ql = QuantLinear(128, 96, QuantScheme.parse("int4-g32"))
    ql.set_codes(pack_int4(q), s, z)
    if ql._labkit_kernel is None:
        pytest.skip("labkit's CPU kernels are not built here: the canonical codes are kept")
    assert ql._labkit_kernel == ("int4_linear_dot" if int4_dot == "1" and
                                 cpu_kernels.kernels().has_int4_dot() else "int4_linear")
    assert {n for n, _ in ql.named_buffers()} == {"kweight", "kscale"}
    state = ql.state_dict()
    assert not hasattr(ql, "qweight")  # no canonical copy: canonical() recovers it
    assert torch.equal(state["qweight"], pack_int4(q)) and torch.equal(ql.canonical()[0],
                                                                        pack_int4(q))
    assert torch.equal(state["scale"], s) and torch.equal(state["zero"], z)
    assert torch.equal(ql.dequantized(), dequantize_int4(q, s, z))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(9))
    before = ql(x)
    again = QuantLinear(128, 96, QuantScheme.parse("int4-g32"))
    again.set_codes(state["qweight"], state["scale"], state["zero"])
    assert torch.equal(again(x), before)
    relayout(ql)  # as after a move: the codes recovered from the layout, the layout rebuilt
    assert torch.equal(ql(x), before) and ql._labkit_kernel == again._labkit_kernel


@pytest.mark.parametrize("spec", SCHEMES)
def test_quant_linear_matches_the_dequantize_reference(spec):
    gen = torch.Generator().manual_seed(4)
    # K = 1152 = 2 x SmolLM2's 576: a multiple of every group, 128 included
    w, x = torch.randn(192, 1152, generator=gen), torch.randn(7, 1152, generator=gen)
    ql = QuantLinear.from_weight(w, QuantScheme.parse(spec), bias=torch.randn(192, generator=gen))
    got, want = ql(x), ql.reference(x)
    # tolerance: bf16 activations (8 bits of mantissa, 2^-9 relative) and bf16 outputs: 1% of
    # the largest output bounds both; a wrong scale, zero or layout misses by far more
    tol = 1e-2 * float(want.abs().max())
    assert float((got - want).abs().max()) <= tol, f"{spec}: kernel and reference differ"
    rel = float((ql.dequantized() - w).norm() / w.norm())
    assert rel < (0.01 if spec == "int8" else 0.12), f"{spec}: quantization error {rel:.3f}"


def test_scheme_names_parse_and_bad_ones_say_what_is_allowed():
    assert QuantScheme.parse("none") is None
    assert QuantScheme.parse("int4").name == "int4-g32"
    assert QuantScheme.parse("int4-g128-awq") == QuantScheme(4, 128, True)
    for bad in ("int3", "int4-g48", "int8-g32", "fp8"):
        with pytest.raises(ValueError, match="int"):
            QuantScheme.parse(bad)


def test_an_all_zero_row_quantizes_to_zeros_not_nan():
    # a pruned output channel: max|w| = 0, and a scale of 0 would give codes 0 / 0 = NaN
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    w[2] = 0
    q, s = quantize_int8(w)
    assert bool(torch.isfinite(s).all()) and float(s[2]) > 0, f"zero row's scale {float(s[2])}"
    assert not bool(q[2].any()), "an all-zero row's int8 codes must be 0"
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(7))
    for spec in ("int8", "int4-g32"):
        ql = QuantLinear.from_weight(w, QuantScheme.parse(spec))
        assert bool((ql.dequantized()[2] == 0).all()), f"{spec}: the zero row dequantizes to 0"
        y = ql(x)  # [3, 4]
        assert bool(torch.isfinite(y).all()) and float(y[:, 2].abs().max()) == 0, spec


def test_a_group_that_does_not_divide_k_is_refused_never_replaced():
    # SmolLM2 reads K = 576 (= 4.5 x 128) in most linears: g128 cannot fit it, and a group of
    # 64 in its place would measure g64 under the name g128
    w = torch.randn(8, 576, generator=torch.Generator().manual_seed(8))
    with pytest.raises(ValueError, match=r"K = 576 .*groups that divide 576: 32, 64"):
        QuantLinear.from_weight(w, QuantScheme.parse("int4-g128"))
    assert QuantLinear.from_weight(w, QuantScheme.parse("int4-g64")).group_size == 64
    model = tiny_model()  # K = 64 (q/k/v, gate/up, o, head) and 128 (down)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"int4-g128 does not fit.*K = 64, 128.*int4-g32, "
                                         r"int4-g64"):
        quantize_model(model, "int4-g128")
    with pytest.raises(ValueError, match="int4-g128-awq does not fit.*int4-g32-awq, int4-g64-awq"):
        quantize_awq(model, "int4-g128-awq", torch.arange(32))
    after = model.state_dict()
    assert model.lm_head is None and all(torch.equal(before[k], after[k]) for k in before), \
        "a refused scheme changed the model"


def test_bench_quant_refuses_g128_on_smollm2_and_names_the_groups_that_fit(capsys):
    from labkit.bench.quant import main as bench_quant_main

    code = bench_quant_main(["--schemes", "int4-g32,int4-g128", "--batches", "1", "--rounds",
                             "1", "--steps", "1", "--nll-tokens", "16", "--gen-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2, "bench quant measured int4-g128 on a model whose K = 576"
    assert "int4-g128 does not fit" in err and "int4-g32, int4-g64" in err, err


def tiny_model(seed: int = 0) -> LlamaModel:
    return init_random(LlamaModel(ModelConfig.tiny(vocab_size=256)), seed).eval()


def logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, torch.arange(len(ids)), CausalAttention(),
                 logit_rows=torch.arange(len(ids)))


def test_tied_head_is_quantized_and_the_embedding_stays_exact():
    model = tiny_model()
    embed = model.embed.weight.clone()
    quantize_model(model, "int4")
    assert isinstance(model.lm_head, QuantLinear)
    assert torch.equal(model.embed.weight, embed), "the embedding lookup must stay exact"
    assert all(isinstance(layer.down_proj, QuantLinear) for layer in model.layers)


def test_awq_fold_leaves_the_fp32_model_unchanged():
    # folding s into the norms / up rows and 1/s... is exact arithmetic: same logits before
    # any rounding (so whatever AWQ changes later is the rounding alone)
    model, ids = tiny_model(), torch.randint(0, 256, (40,), generator=torch.Generator())
    want = logits(model, ids)
    untie_head(model)
    report = apply_awq(model, QuantScheme.parse("int4-g32-awq"), ids)
    torch.testing.assert_close(logits(model, ids), want, atol=1e-4, rtol=1e-4)
    assert all(err <= rtn for err, rtn in report.values()), "alpha=0 (plain RTN) is searched"


def test_awq_scale_search_beats_rtn_on_an_outlier_channel():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 64, generator=gen)
    x[:, 3] *= 30  # one channel that large activations hit
    w = torch.randn(32, 64, generator=gen)
    s, err, rtn = search_scale(x, [w], QuantScheme.parse("int4-g32"))
    assert err < 0.8 * rtn and float(s[3]) == float(s.max())


@pytest.mark.parametrize("spec", ["int8", "int4-g64-awq"])
def test_quantized_state_round_trips(spec):
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(6))
    scheme = QuantScheme.parse(spec)
    model = (quantize_awq(tiny_model(), scheme, ids) if scheme.awq
             else quantize_model(tiny_model(), scheme))
    again = load_quantized(tiny_model(), QuantScheme.parse(spec), quantized_state(model))
    assert torch.equal(logits(again, ids), logits(model, ids))


@pytest.mark.parametrize("spec", ["int8", "int4-g32"])
def test_fused_projections_give_the_same_logits(spec):
    # q|k|v and gate|up stacked into one QuantLinear each: every output row is rounded on its
    # own, so the fused model computes the same numbers with 3 fewer linear calls a layer
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(8))
    model = quantize_model(tiny_model(), spec)
    want = logits(model, ids)
    model.fuse_projections()
    assert isinstance(model.layers[0].qkv_proj, QuantLinear) and not hasattr(model.layers[0],
                                                                            "q_proj")
    torch.testing.assert_close(logits(model, ids), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="before fuse_projections"):
        quantize_model(model, spec)


def test_loading_awq_from_the_cache_leaves_models_that_share_its_weights_alone():
    # load_model's fp32 models of one file share tensors; a cached AWQ entry carries folded
    # norms, and writing them into the shared ones once turned fp32 (and every scheme built
    # after) into a different model: bench quant scored fp32 at NLL 3.33 instead of 2.57
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(9))
    fp32 = tiny_model()
    want = logits(fp32, ids)
    state = quantized_state(quantize_awq(tiny_model(), QuantScheme.parse("int4-g32-awq"), ids))
    shared = LlamaModel(fp32.cfg)
    shared.load_state_dict(fp32.state_dict(), assign=True)  # the same tensors, as load_model
    assert shared.layers[0].input_norm.data_ptr() == fp32.layers[0].input_norm.data_ptr()
    awq = load_quantized(shared, QuantScheme.parse("int4-g32-awq"), state)
    assert not torch.equal(awq.layers[0].input_norm, fp32.layers[0].input_norm)
    assert torch.equal(logits(fp32, ids), want), "loading AWQ rewrote the fp32 model's norms"


def test_the_real_fp32_model_survives_loading_every_scheme(smollm2):
    # end to end through the cache: the AWQ entry read back (the second load) must leave the
    # session's fp32 model as it was, and int4 built after it must still be plain RTN
    model, tok = smollm2
    ids = torch.tensor(tok.encode("The memory wall: decode reads every weight each step."))
    want = logits(model, ids)
    for spec in ("int4-g32-awq", "int4-g32-awq", "int4-g32"):
        load_model("smollm2-135m", quant=spec)
    assert torch.equal(logits(model, ids), want), "a quantized load changed the fp32 model"


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_quantized_engine_gives_the_same_tokens_on_both_decoders(spec):
    from labkit import Engine
    from labkit.sampling import SamplingParams

    model, tok = load_model("tiny", quant=spec, fuse=True)
    prompts = [[5, 9, 200, 7], [100, 3], [42] * 9]
    outs = {}
    for device in ("inprocess", "process"):
        engine = Engine(model, tok, device=device, kv_tokens=512, max_seqs=4)
        try:
            for decoder in ("blocking", "pipelined"):
                rids = [engine.submit(p, SamplingParams(max_new_tokens=10, temperature=0.8,
                                                        seed=i, ignore_eos=True))
                        for i, p in enumerate(prompts)]
                run(engine, decoder)
                outs[device, decoder] = [engine.completion(r, i, None).output_ids
                                         for i, r in enumerate(rids)]
                for r in rids:
                    engine.forget(r)
        finally:
            engine.close()
    first = outs["inprocess", "blocking"]
    assert all(o == first for o in outs.values()), f"{spec}: decoders disagree: {outs}"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True,
                          text=True, timeout=300)


def test_eval_ppl_refuses_bad_files_with_one_line(tmp_path, capsys):
    # in process (each `python -m labkit` costs seconds of imports): main() is what it runs
    from labkit.bench.eval_ppl import main

    empty, binary = tmp_path / "empty.txt", tmp_path / "x.bin"
    empty.write_text("  \n")
    binary.write_bytes(b"\x00\x01\x02abc")
    for path, why in [(tmp_path / "missing.txt", "no such file"), (empty, "empty"),
                      (binary, "not a text file")]:
        assert main(["ppl", "--file", str(path), "--model", "tiny"]) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err


def test_eval_ppl_scores_a_text_quantized(tmp_path, capsys):
    import json

    from labkit.bench.eval_ppl import main

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    assert main(["ppl", "--file", str(text), "--model", "tiny", "--quant", "int8",
                 "--window", "64", "--stride", "32", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["quant"] == "int8" and row["tokens"] > 100 and row["ppl"] > 1


@pytest.mark.cuda
@pytest.mark.parametrize("spec", ["int8", "int4-g32", "int4-g128"])
def test_quant_linear_on_cuda_matches_the_reference(spec):
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(256, 512, generator=gen), torch.randn(5, 512, generator=gen)
    ql = QuantLinear.from_weight(w, QuantScheme.parse(spec))
    want = ql.reference(x)
    ql = relayout(ql.cuda())  # the CUDA kernel's own layout (as CudaDevice does)
    # labkit's CPU kernels stand aside (on the tests' fake CUDA the tensors stay on the CPU, so
    # a CPU layout is chosen, and its kernel stands aside at the call, under the fake's mode)
    assert ql._labkit_kernel is None or spec == "int8" or not ql.kweight.is_cuda
    got = ql(x.cuda()).cpu()
    assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())


def test_generate_and_bench_quant_take_the_flag(capsys):
    import json

    from labkit.bench.quant import main as bench_quant_main
    from labkit.cli import generate_main

    r = run_cli("generate", "--model", "tiny", "--quant", "int4-g64", "--max-new-tokens", "3",
                "--json", "Hello")
    assert r.returncode == 0 and "quant int4-g64" in r.stderr, r.stderr
    assert generate_main(["--model", "tiny", "--quant", "int5", "Hello"]) == 2
    assert "--quant" in capsys.readouterr().err
    assert bench_quant_main(["--model", "tiny", "--schemes", "int8", "--batches", "1",
                             "--rounds", "1", "--steps", "2", "--gen-tokens", "4",
                             "--nll-tokens", "64", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["quant"] for row in rows] == ["none", "int8"]
    assert rows[1]["weight_bytes"] < rows[0]["weight_bytes"] / 3
    for row in rows:  # decode alone (after the first token) beside the whole request
        assert row["tok_s_decode"] > 0 and row["decode_speedup_vs_fp32"] > 0
    assert rows[0]["decode_speedup_vs_fp32"] == 1.0  # fp32 against itself, turn by turn
    assert rows[0]["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and rows[0]["cpu"]


@pytest.mark.parametrize("spec", ["int8", "int4-g32", "int4-g32-awq"])
def test_a_fused_load_from_codes_equals_fusing_after_the_load(spec):
    # load_model(quant=...) stacks q|k|v and gate|up from the cached codes, without building
    # the separate linears first: the same buffers and logits as fuse_projections after a load
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(10))
    scheme = QuantScheme.parse(spec)
    state = quantized_state(quantize_awq(tiny_model(), scheme, ids) if scheme.awq
                            else quantize_model(tiny_model(), scheme))
    want = load_quantized(tiny_model(), scheme, state).fuse_projections()
    got = load_quantized(tiny_model(), scheme, state, fuse=True)
    assert isinstance(got.layers[0].qkv_proj, QuantLinear) and not hasattr(got.layers[0],
                                                                          "up_proj")
    bufs = dict(got.named_buffers())
    assert sorted(bufs) == sorted(dict(want.named_buffers()))
    assert all(torch.equal(b, bufs[n]) for n, b in want.named_buffers())
    assert torch.equal(logits(got, ids), logits(want, ids))
