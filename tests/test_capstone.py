"""The whole engine (labkit.whole_engine): every feature on gives the plain engine's tokens
where the features allow (greedy, fp32), on both decoders; quantized, the decoders agree."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from labkit.decoders import run
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.sampling import SamplingParams
from labkit.whole_engine import FEATURES, EngineSetup

SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15]  # a prompt prefix of two full pages (block_size 4)


def _tiny():
    return init_random(LlamaModel(ModelConfig.tiny()).eval(), seed=3)


def _tokens(setup: EngineSetup, model, decoder: str | None = None) -> list[list[int]]:
    """Greedy outputs of a mixed workload: long prompts (chunked under a 16-token budget),
    shared prefixes, more requests than rows, a cancel-free run to each request's length."""
    if setup.max_step_tokens is not None:  # a budget the prompts exceed: chunks, mixed steps
        setup = dataclasses.replace(setup, max_step_tokens=16)
    engine = setup.build(model, None, kv_tokens=512, block_size=4, max_seqs=3)
    if setup.attention == "flash":
        engine.device.runner.backend.tile_tokens = 8  # many tiles per step
    if setup.max_step_tokens is not None:
        assert engine.scheduler.max_step_tokens == setup.max_step_tokens
    gen = torch.Generator().manual_seed(0)
    ids = []
    for i, n in enumerate([3, 37, 20, 9, 26]):
        prompt = torch.randint(3, 200, (n,), generator=gen).tolist()
        if i % 2:
            prompt = SHARED + prompt  # every other request shares a prefix
        params = SamplingParams(max_new_tokens=10 + i, temperature=0.0, ignore_eos=True)
        ids.append(engine.submit(prompt, params))
    run(engine, decoder or setup.decoder)
    out = [list(engine.seqs[r].output_ids) for r in ids]
    engine.check_all_released()
    stats = engine.stats
    engine.close()
    if setup.prefix_caching and setup.kv_reserve == "on_demand":
        assert stats.prefill_tokens_saved > 0, "prefix sharing saved no prefill work"
    return out


def test_setups_name_their_features():
    whole, plain = EngineSetup.whole(), EngineSetup.plain()
    assert whole.off() == [] and plain.off() == list(FEATURES)
    assert whole.quant == "int8" and plain.attention == "naive"
    for name in FEATURES:
        assert whole.without(name).off() == [name]
    with pytest.raises(ValueError, match="unknown feature"):
        whole.without("speculative decoding")
    with pytest.raises(ValueError, match="quantization"):
        EngineSetup(quant="int3")
    with pytest.raises(ValueError, match="max_step_tokens"):
        EngineSetup(max_step_tokens=0)


@pytest.mark.parametrize("decoder", ["blocking", "pipelined"])
def test_the_whole_engine_gives_the_plain_engines_tokens(decoder):
    model = _tiny()
    plain = _tokens(EngineSetup.plain(), model, decoder)
    assert _tokens(EngineSetup.whole(quant=None), model, decoder) == plain, (
        "every feature on (fp32, greedy) must not change a token: a feature that does is a bug "
        "(chunk boundaries, shared pages or the flash tiles)")


@pytest.mark.parametrize("feature", [f for f in FEATURES if f != "quantized weights"])
def test_each_feature_off_in_turn_keeps_the_tokens(feature):
    model = _tiny()
    whole = EngineSetup.whole(quant=None)
    assert _tokens(whole.without(feature), model) == _tokens(whole, model), feature


def test_quantized_whole_engine_agrees_on_both_decoders():
    model = _tiny()
    for quant in ("int8", "int4-g32"):
        setup = EngineSetup.whole(quant=quant)
        blocking = _tokens(setup, model, "blocking")
        assert _tokens(setup, model, "pipelined") == blocking, quant
        # quantization is the one feature allowed to change tokens: the plain engine over the
        # same quantized weights gives the whole engine's
        plain_q = dataclasses.replace(EngineSetup.plain(), quant=quant)
        assert _tokens(plain_q, model) == blocking, quant
    assert next(model.parameters()).dtype == torch.float32, "build() quantized the fp32 model"


def test_every_setup_runs_its_projections_fused_and_leaves_the_given_model_as_it_was():
    # the engine's entry points load models fused (q|k|v, gate|up: fewer calls a step), so a
    # setup built over a per-projection fp32 model runs a fused copy, made once per `quantized`
    # cache and shared, as each quantized copy is; the model given keeps its layout
    model = _tiny()
    assert all(layer.qkv_proj is None for layer in model.layers)
    shared: dict = {}
    engines = [setup.build(model, None, quantized=shared, kv_tokens=64, block_size=4)
               for setup in (EngineSetup.plain(), EngineSetup.whole(quant=None),
                             EngineSetup.whole(quant="int8"))]
    runs = [e.device.runner.model for e in engines]
    for e in engines:
        e.close()
    assert all(layer.qkv_proj is not None and layer.gate_up_proj is not None
               for m in runs for layer in m.layers)
    assert runs[0] is runs[1] is shared[None] and runs[2] is shared["int8"]
    assert all(layer.qkv_proj is None for layer in model.layers), "build() fused the given model"
    # a model given fused already runs as it is: no copy
    fused = shared[None]
    engine = EngineSetup.plain().build(fused, None, kv_tokens=64, block_size=4)
    assert engine.device.runner.model is fused
    engine.close()
