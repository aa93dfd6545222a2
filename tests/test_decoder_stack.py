"""The C++ decoder stack runs the Python layers' ops, bit for bit, and only where it serves."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from labkit.attention import BACKENDS, FlashAttention, FlashMeta
from labkit.kernels import cpu as cpu_kernels
from labkit.kernels import stack as decoder_stack
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.paged_kv import PagedKVCache
from labkit.quant import quantize_model

needs_kernels = pytest.mark.skipif(cpu_kernels.kernels() is None,
                                   reason=f"labkit's CPU kernels: {cpu_kernels.status()}")

BLOCK = 4


def _model(quant: str | None, fuse: bool, bias: bool = False) -> LlamaModel:
    cfg = ModelConfig.tiny().with_(attention_bias=bias)
    model = init_random(LlamaModel(cfg).eval(), seed=11)
    if quant is not None:
        model = quantize_model(model, quant)
    if fuse:
        model.fuse_projections()
    return model


def _steps(model, backend: str):
    """A prefill of two sequences (5 and 7 tokens), then two decode steps: the logits of every
    step and the KV pool after them."""
    cfg = model.cfg
    cache = PagedKVCache(cfg, 16, BLOCK, torch.float32)
    attn = FlashAttention(cache) if backend == "flash" else BACKENDS[backend](cache)
    meta_type = FlashMeta if backend == "flash" else type(attn).meta_type
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    gen = torch.Generator().manual_seed(0)
    out = []
    lens, starts = torch.tensor([5, 7]), torch.tensor([0, 0])
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (int(lens.sum()),), generator=gen)
        meta = meta_type.build(lens, starts, tables, BLOCK)
        attn.begin_step(meta)
        out.append(model(ids, meta.positions, attn, logit_rows=meta.last_rows))
        starts = starts + lens
        lens = torch.tensor([1, 1])
    return out, cache.k.clone(), cache.v.clone()


@needs_kernels
@pytest.mark.parametrize("backend", ["paged", "flash"])
@pytest.mark.parametrize(("quant", "fuse", "bias"), [
    (None, False, False), (None, True, False), (None, False, True), ("int8", True, False),
    ("int4-g32", True, False), ("int8", False, True)])
def test_stack_equals_the_python_layers_bit_for_bit(backend, quant, fuse, bias):
    model = _model(quant, fuse, bias)
    with decoder_stack.disabled():
        want = _steps(model, backend)
    got = _steps(model, backend)
    assert decoder_stack.for_step(model, torch.zeros(1, model.cfg.hidden_size),
                                  _attn_for(model, backend)) is not None  # it ran
    for g, w in zip(got[0], want[0]):
        assert torch.equal(g, w)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # the same KV


def _prefill_logits(model, backend: str, rows: torch.Tensor | None = None):
    """A prefill of two sequences (5 and 7 tokens) with the logits of `rows` (None: every
    row's, [12, V])."""
    cache = PagedKVCache(model.cfg, 16, BLOCK, torch.float32)
    attn = FlashAttention(cache) if backend == "flash" else BACKENDS[backend](cache)
    meta_type = FlashMeta if backend == "flash" else type(attn).meta_type
    meta = meta_type.build(torch.tensor([5, 7]), torch.tensor([0, 0]),
                           torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), BLOCK)
    attn.begin_step(meta)
    ids = torch.randint(0, model.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    return model(ids, meta.positions, attn, logit_rows=rows), attn


@needs_kernels
@pytest.mark.parametrize("quant", [None, "int4-g32"])
@pytest.mark.parametrize("tied", [True, False])
def test_the_whole_forward_in_one_call_equals_the_python_path(quant, tied):
    # the embedding, the layers, the final norm and the head in C++ (for_logits): every row's
    # logits, a tied or an untied head, fp32 or quantized, the Python path's bits
    cfg = ModelConfig.tiny().with_(tie_embeddings=tied)
    model = init_random(LlamaModel(cfg).eval(), seed=5)
    if quant is not None:
        model = quantize_model(model, quant)
    with decoder_stack.disabled():
        want, _ = _prefill_logits(model, "paged")
    got, attn = _prefill_logits(model, "paged")
    assert decoder_stack.for_logits(model, attn) is not None  # it ran
    assert got.shape == (12, cfg.vocab_size) and torch.equal(got, want)
    # rows as Python indexes them: none at all (a step whose prompts are all mid-chunk), a
    # negative one, a mask
    for rows in (torch.tensor([], dtype=torch.long), torch.tensor([-1, 3]),
                 torch.arange(12) % 5 == 0):
        with decoder_stack.disabled():
            want, _ = _prefill_logits(model, "paged", rows)
        got, _ = _prefill_logits(model, "paged", rows)
        assert got.shape == want.shape and torch.equal(got, want), rows


@needs_kernels
def test_the_whole_forward_grows_the_rope_table_and_refuses_a_negative_position(monkeypatch):
    # the one C++ call copies RoPE's rows from labkit.model's table; a position past its end
    # (here a table of 4 rows, positions up to 8) grows it, and the step runs once, as Python's
    import labkit.model as model_module

    model = _model("int4-g32", True)
    with decoder_stack.disabled():
        want = _steps(model, "paged")
    monkeypatch.setattr(model_module, "_ROPE_CHUNK", 2)
    monkeypatch.setattr(model_module, "_ROPE_ROWS", {})
    assert model_module.rope_table(model.cfg.head_dim, model.cfg.rope_theta)[0].shape[0] == 4
    got = _steps(model, "paged")
    assert model_module.rope_table(model.cfg.head_dim, model.cfg.rope_theta)[0].shape[0] > 8
    for g, w in zip(got[0], want[0]):
        assert torch.equal(g, w)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # the KV written once
    _, attn = _prefill_logits(model, "paged")
    assert decoder_stack.for_logits(model, attn) is not None
    ids = torch.zeros(12, dtype=torch.long)
    with pytest.raises(ValueError, match="negative position"):
        model(ids, torch.arange(12) - 1, attn)
    with pytest.raises(IndexError):  # a logit row out of range: its own error, as Python's
        model(ids, torch.arange(12), attn, logit_rows=torch.tensor([12]))


@needs_kernels
def test_a_hook_on_the_head_or_the_embedding_keeps_the_python_path():
    model = _model(None, False)
    _, attn = _prefill_logits(model, "paged")
    assert decoder_stack.for_logits(model, attn) is not None
    seen = []
    handle = model.embed.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    assert decoder_stack.for_logits(model, attn) is None
    got, _ = _prefill_logits(model, "paged")  # the layers still in C++, the ends in Python
    assert seen == [(12, model.cfg.hidden_size)]
    handle.remove()
    with decoder_stack.disabled():
        want, _ = _prefill_logits(model, "paged")
    assert torch.equal(got, want)


def _attn_for(model, backend):
    cache = PagedKVCache(model.cfg, 16, BLOCK, torch.float32)
    attn = FlashAttention(cache) if backend == "flash" else BACKENDS[backend](cache)
    meta_type = FlashMeta if backend == "flash" else type(attn).meta_type
    attn.begin_step(meta_type.build(torch.tensor([1]), torch.tensor([0]),
                                    torch.tensor([[0]]), BLOCK))
    return attn


@needs_kernels
def test_stack_stands_aside_where_it_does_not_serve():
    model = _model("int8", True)
    x = torch.zeros(1, model.cfg.hidden_size)
    assert decoder_stack.for_step(model, x, _attn_for(model, "naive")) is None  # no kernel
    assert decoder_stack.for_step(model, x.bfloat16(), _attn_for(model, "paged")) is None
    with decoder_stack.disabled():
        assert decoder_stack.for_step(model, x, _attn_for(model, "paged")) is None
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):  # a torch mode must see aten ops: the stack stands aside
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Watch():
        assert decoder_stack.for_step(model, x, _attn_for(model, "paged")) is None


@needs_kernels
def test_stack_follows_the_model_when_its_modules_change():
    model = _model(None, False)
    attn = _attn_for(model, "paged")
    x = torch.zeros(1, model.cfg.hidden_size)
    first = decoder_stack._STACKS.get(model) if decoder_stack.for_step(model, x, attn) else None
    assert first is not None
    model.fuse_projections()  # new modules: a new stack, not the old one's weights
    decoder_stack.for_step(model, x, attn)
    assert decoder_stack._STACKS[model] is not first
    clone = copy.deepcopy(model)  # a model with a stack still copies (the stack is not in it)
    assert clone is not model


@needs_kernels
def test_a_swapped_module_rebuilds_the_stack_and_an_unchanged_model_is_not_rechecked(
        monkeypatch):
    model = _model(None, False)
    attn = _attn_for(model, "paged")
    x = torch.randn(1, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    assert decoder_stack.for_step(model, x, attn) is not None
    first = decoder_stack._STACKS[model]

    def no_key(m):
        raise AssertionError("the key was read with no module registered since")
    monkeypatch.setattr(decoder_stack, "_key", no_key)
    assert decoder_stack.for_step(model, x, attn) is not None  # nothing changed: not re-read
    assert decoder_stack._STACKS[model] is first
    monkeypatch.undo()
    old = model.layers[0].o_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    new.weight.data.copy_(2 * old.weight)
    model.layers[0].o_proj = new  # a registration: the stack is checked, and rebuilt
    decoder_stack.for_step(model, x, attn)
    assert decoder_stack._STACKS[model][1] is not first[1]


@needs_kernels
def test_stack_reports_the_time_spent_in_kernels():
    model = _model("int8", True)
    attn = _attn_for(model, "paged")
    x = torch.randn(1, model.cfg.hidden_size)
    from labkit.model import rope_tables

    cos, sin = rope_tables(model.cfg.head_dim, model.cfg.rope_theta, torch.tensor([0]))
    run = decoder_stack.for_step(model, x, attn)
    with decoder_stack.profiling() as prof:
        t0 = time.perf_counter()
        run(x, cos, sin)
        wall = time.perf_counter() - t0
    assert 0 < prof["kernel_s"] <= wall
    # the same seconds by kind: each kind ran (a layer has all three); kernel_s is their sum
    assert set(prof["split"]) == {"linears", "attention", "row ops"}
    assert all(sec > 0 for sec in prof["split"].values()), prof["split"]
    assert sum(prof["split"].values()) == pytest.approx(prof["kernel_s"], rel=1e-9)
    run(x, cos, sin)  # outside the block: nothing more is counted
    assert sum(decoder_stack._state["split"]) == prof["kernel_s"]
