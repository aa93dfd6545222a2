"""Weights in: GGUF reading and caching, HF conversion, the tokenizer and its streaming decoder."""

from __future__ import annotations

import importlib.util
import os
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from labkit import loading
from labkit.loading import TINY_VOCAB, config_from_hf, from_hf, load_model
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.tokenizer import tokenizer_from_gguf
from labkit.utils import cache as model_cache
from labkit.utils.cache import INSTALL_COMMAND, ModelNotInstalled

# `make` always installs gguf; a bare GPU image may not have it, and there only the tests
# marked cuda run (scripts/gpu_check.sh): collecting this module must not stop them
gguf = pytest.importorskip("gguf")

# --- a tiny GGUF, written here the way llama.cpp's converter writes a Llama model ---------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: unk, bos, eos
MERGES = ["h e", "l l", "he ll", "Ġ w", "o r"]  # a few, so the BPE has something to merge
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BYTE_TOKENS = list(bytes_to_unicode().values())  # GPT-2's printable spelling of the 256 bytes
TOKENS = SPECIALS + BYTE_TOKENS + [m.replace(" ", "") for m in MERGES]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: rotate-half rows -> adjacent pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path, model: LlamaModel) -> None:
    """Write `model` as an F32 Llama GGUF, with a tiny byte-level BPE tokenizer."""
    cfg = model.cfg
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT)
    w.add_tensor("token_embd.weight", sd["embed.weight"])
    w.add_tensor("output_norm.weight", sd["final_norm"])
    if not cfg.tie_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_norm"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "q_proj.weight"], cfg.num_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "k_proj.weight"], cfg.num_kv_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attn_norm"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_model(seed: int, tied: bool = True) -> LlamaModel:
    cfg = ModelConfig.tiny(vocab_size=len(TOKENS)).with_(tie_embeddings=tied)
    return init_random(LlamaModel(cfg), seed=seed)


def assert_same_weights(ours: LlamaModel, ref: LlamaModel) -> None:
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys(), f"parameter names differ: {set(a) ^ set(b)}"
    for name in a:
        assert torch.equal(a[name], b[name]), (
            f"{name} differs after loading (max |d| = {(a[name] - b[name]).abs().max():.2e}); "
            "for q_proj/k_proj, suspect the un-permutation of llama.cpp's rows (unpermute_qk)")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty LABKIT_CACHE and an empty in-process memo, for this test only."""
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "_WEIGHTS", {})
    monkeypatch.setattr("labkit.tokenizer._TOKENIZERS", {})
    return tmp_path / "cache"


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_round_trip_through_the_cache(tmp_path, cache, monkeypatch, tied):
    ref = tiny_model(seed=1, tied=tied)
    path = tmp_path / "tiny.gguf"  # the file's stem names the model
    write_gguf(path, ref)

    model, tok = load_model(str(path))
    assert model.cfg == ref.cfg
    assert_same_weights(model, ref)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert (tok.eos_id, tok.bos_id, tok.vocab_size) == (2, 1, len(TOKENS))
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.encode("hi", chat=True)[0] == 1  # the template starts with <|im_start|>

    # a fresh process: nothing in memory, the dequantized weights come from the disk cache
    (entry,) = cache.iterdir()
    assert sorted(p.name for p in entry.iterdir()) == ["model", "tokenizer"]
    monkeypatch.setattr(loading, "_WEIGHTS", {})
    monkeypatch.setattr("labkit.tokenizer._TOKENIZERS", {})
    with monkeypatch.context() as m:
        m.setattr(loading, "read_gguf", lambda *a: pytest.fail("cache missed: GGUF read again"))
        again, _ = load_model(str(path))
    assert_same_weights(again, ref)

    # the same file elsewhere, newer (a reinstall into a fresh environment): the same entry
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(loading, "_WEIGHTS", {})
    with monkeypatch.context() as m:
        m.setattr(loading, "read_gguf", lambda *a: pytest.fail("cache missed: GGUF read again"))
        load_model(str(moved / path.name))
    assert len(list(cache.iterdir())) == 1

    # the file changes: the cache key changes with it, and the new weights are read
    changed = tiny_model(seed=2, tied=tied)
    write_gguf(path, changed)
    st_ = path.stat()  # the in-process memo of the key goes by path, size and mtime: a new
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))  # mtime, even on a coarse clock
    assert_same_weights(load_model(str(path))[0], changed)


def test_interrupted_dequantization_leaves_no_cache_entry(tmp_path, cache, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_model(seed=1))

    def crash(*args):
        raise KeyboardInterrupt  # as if the learner pressed Ctrl-C during the first load

    with monkeypatch.context() as m:
        m.setattr(loading, "read_gguf", crash)
        with pytest.raises(KeyboardInterrupt):
            loading.from_gguf(path)
    assert not any((p / "model").exists() for p in cache.iterdir()), "half-written cache entry"
    assert not [p for p in cache.rglob("*.tmp-*")], "temporary directory left behind"
    assert_same_weights(loading.from_gguf(path), tiny_model(seed=1))


def test_unsupported_gguf_is_refused(tmp_path, cache):
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        loading.from_gguf(path)


def test_missing_model_package_says_how_to_install(monkeypatch, cache):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == model_cache.PACKAGE else real(name, *a))
    with pytest.raises(ModelNotInstalled) as info:
        load_model("smollm2-135m")
    msg = str(info.value)
    assert INSTALL_COMMAND in msg and "make lab" in msg, msg
    assert isinstance(info.value, RuntimeError)


def test_unknown_model_name_lists_the_choices():
    with pytest.raises(ValueError) as info:
        load_model("smollm3-9000b")
    msg = str(info.value)
    assert "'smollm2-135m'" in msg and "'tiny'" in msg and "exist" in msg, msg


def test_from_hf_round_trip_llama_and_qwen2(tmp_path):
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    for hf in (LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True)),
               Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))):
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_()  # biases and norms too, so a misplaced one cannot hide
        model = from_hf(hf)
        ours = model.state_dict()
        theirs = hf.state_dict()
        for name, w in theirs.items():
            mapped = (name.replace("model.embed_tokens", "embed")
                      .replace("model.norm.weight", "final_norm")
                      .replace("model.layers", "layers").replace("self_attn.", "")
                      .replace("mlp.", "").replace("input_layernorm.weight", "input_norm")
                      .replace("post_attention_layernorm.weight", "post_attn_norm"))
            if mapped == "lm_head.weight" and model.cfg.tie_embeddings:
                mapped = "embed.weight"
            assert torch.equal(ours[mapped], w), f"{name} -> {mapped} differs"
        assert model.cfg.attention_bias == isinstance(hf, Qwen2ForCausalLM)
        assert ours["embed.weight"].data_ptr() != theirs["model.embed_tokens.weight"].data_ptr()

        hf.save_pretrained(tmp_path / hf.config.model_type)  # the directory path
        assert_same_weights(from_hf(tmp_path / hf.config.model_type), model)


@pytest.mark.parametrize("change, complaint", [
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "RoPE"),
    (dict(attention_bias=True), "o_proj"),
    (dict(hidden_act="gelu"), "silu"),
])
def test_config_from_hf_refuses_what_labkit_cannot_run(change, complaint):
    with pytest.raises(ValueError, match=complaint):
        config_from_hf(LlamaConfig(**change))


def test_config_from_hf_reads_qwen2_and_head_dim():
    cfg = config_from_hf(Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=128, num_hidden_layers=1, vocab_size=10))
    assert cfg.attention_bias and cfg.head_dim == 16 and cfg.num_kv_heads == 2
    cfg = config_from_hf(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32))
    assert cfg.head_dim == 32 and not cfg.attention_bias
    with pytest.raises(ValueError, match="not supported"):
        config_from_hf(type("Cfg", (), {"model_type": "gpt2"})())


# --- the real SmolLM2 and its tokenizer --------------------------------------------------------


@pytest.mark.slow
def test_smollm2_config_and_tokenizer(smollm2):
    model, tok = smollm2
    assert model.cfg == ModelConfig.smollm2_135m()
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert (tok.eos_id, tok.vocab_size) == (2, 49152)
    assert tok.hf.convert_ids_to_tokens(tok.eos_id) == "<|im_end|>"
    ids = tok.encode("What is 2+2?", chat=True)
    text = tok.hf.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert tok.decode(ids).endswith("assistant\n")  # specials skipped


@pytest.mark.slow
def test_smollm2_cached_load_is_fast(smollm2, monkeypatch):
    # the fixture loaded it once (dequantizing if this machine never had); now only the disk cache
    monkeypatch.setattr(loading, "_WEIGHTS", {})
    monkeypatch.setattr("labkit.tokenizer._TOKENIZERS", {})
    start = time.perf_counter()
    model, tok = load_model("smollm2-135m")
    seconds = time.perf_counter() - start
    print(f"cached load of smollm2-135m: {seconds:.2f} s")
    assert seconds < 10, f"cached load took {seconds:.1f} s (target < 3 s): is the cache used?"
    assert model.state_dict()["layers.29.k_proj.weight"].equal(
        smollm2[0].state_dict()["layers.29.k_proj.weight"])

    start = time.perf_counter()
    again, _ = load_model("smollm2-135m")
    assert time.perf_counter() - start < 1.0, "the in-process memo should make this instant"
    assert again is not model  # a fresh module each time, sharing the read-only weights


@pytest.mark.slow
def test_tiny_preset_has_real_tokenizer_and_seeded_weights():
    model, tok = load_model("tiny")
    assert model.cfg == ModelConfig.tiny(vocab_size=TINY_VOCAB)  # SmolLM2's first tokens
    ids = tok.encode("Say hello to SmolLM, trained by Hugging Face", chat=True)
    assert ids and max(ids) < TINY_VOCAB  # prompt ids are folded into the model's range
    assert tok.eos_id == 2
    assert_same_weights(model, load_model("tiny")[0])


def stream(tok, ids: list[int]) -> tuple[list[str], str]:
    det = tok.detokenizer()
    return [det.push(i) for i in ids], det.flush()


@pytest.mark.slow
def test_detokenizer_waits_for_whole_characters(smollm2):
    _, tok = smollm2
    text = "héllo 世界 🙂 naïve café — ok"
    ids = tok.encode(text)
    pieces, rest = stream(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids) == text
    assert rest == "", "valid text should be fully emitted by the pushes"
    assert "" in pieces, "some tokens end mid-character (世 is split into bytes): push holds back"
    assert not any("\ufffd" in p for p in pieces), f"a partial character leaked: {pieces}"


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_detokenizer_pushes_concatenate_to_decode_of_text(smollm2, text):
    _, tok = smollm2
    ids = tok.encode(text)
    pieces, rest = stream(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=30))
def test_detokenizer_pushes_concatenate_to_decode_of_any_ids(smollm2, ids):
    _, tok = smollm2  # random ids: stray UTF-8 bytes, special tokens, anything
    pieces, rest = stream(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids)


def test_tokenizer_from_gguf_is_cached(tmp_path, cache, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_model(seed=1))
    first = tokenizer_from_gguf(path)
    monkeypatch.setattr("labkit.tokenizer._TOKENIZERS", {})
    from transformers import AutoTokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda *a, **k: pytest.fail("tokenizer rebuilt instead of read from cache"))
    second = tokenizer_from_gguf(path)
    assert second.encode("hello world") == first.encode("hello world")


def test_load_model_from_a_checkpoint_directory(tmp_path, cache):
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, tiny_model(seed=1))
    hf_dir = tmp_path / "checkpoint"
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=len(TOKENS), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=1, tie_word_embeddings=False))
    hf.save_pretrained(hf_dir)
    tokenizer_from_gguf(gguf_path).hf.save_pretrained(hf_dir)  # any tokenizer will do

    model, tok = load_model(str(hf_dir))
    assert_same_weights(model, from_hf(hf))
    assert model.cfg.name == "checkpoint" and not model.cfg.tie_embeddings
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tok.eos_id == 2 and tok.decode(tok.encode("hello")) == "hello"


def test_first_load_shows_progress_on_stderr_and_a_cached_load_none(tmp_path, cache, capsys):
    """The first load (30-60 s for SmolLM2) says what it does, on stderr only, so that a
    command's --json stdout stays clean; a cached load is silent."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_model(seed=1))
    load_model(str(path))
    out, err = capsys.readouterr()
    assert out == ""
    for step in ("reading tiny.gguf", "dequantizing tiny.gguf", "caching the fp32 weights",
                 "building the tokenizer"):
        assert step in err, (step, err)
    loading._WEIGHTS.clear()
    load_model(str(path))
    assert capsys.readouterr() == ("", "")


def test_the_memo_shares_what_a_live_model_holds_and_lets_the_rest_go(tmp_path, cache):
    # models of one file share their tensors (and the mapped pages under them) while one of
    # them lives; a tensor that no model holds any more (fusing replaced it with a copy, its
    # model was deleted) is not kept by the memo, so its pages leave memory with it
    import gc

    ref = tiny_model(seed=1)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, ref)
    a, _ = load_model(str(path))
    b, _ = load_model(str(path))
    assert b.layers[0].q_proj.weight is a.layers[0].q_proj.weight  # shared, not mapped again
    del b
    a.fuse_projections()  # a's separate q, k, v, gate and up go; o, down and the rest stay
    gc.collect()
    ((_, live),) = loading._WEIGHTS.values()
    assert "layers.0.q_proj.weight" not in live and "layers.0.gate_proj.weight" not in live
    assert live["layers.0.o_proj.weight"] is a.layers[0].o_proj.weight
    c, _ = load_model(str(path))  # what no model held is mapped again, what a holds is shared
    assert_same_weights(c, ref)
    assert c.layers[0].o_proj.weight is a.layers[0].o_proj.weight
    half, _ = load_model(str(path), dtype=torch.bfloat16)  # a copy: its own, never memoized
    assert half.embed.weight.dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for t in live.values())


def test_a_safetensors_file_read_module_by_module_gives_every_tensor_as_saved(tmp_path):
    # the reader quantized models load through (labkit.loading._ModuleByModule): its own
    # header parse and one mapping per module give what safetensors' own reader gives
    from safetensors.torch import load_file, save_file

    from labkit.loading import _ModuleByModule

    gen = torch.Generator().manual_seed(0)
    state = {"layers.0.o_proj.qweight": torch.randint(0, 255, (48, 16), generator=gen,
                                                      dtype=torch.uint8),
             "layers.0.o_proj.scale": torch.randn(48, 1, generator=gen),
             "layers.0.input_norm": torch.randn(32, generator=gen),
             "layers.1.down_proj.qweight": torch.randint(-127, 127, (5, 3), generator=gen,
                                                         dtype=torch.int8),
             "lm_head.kscale": torch.randn(7, 9, generator=gen).bfloat16(),
             "final_norm": torch.randn(32, generator=gen)}
    save_file(state, str(tmp_path / "q.safetensors"))
    lazy = _ModuleByModule(tmp_path / "q.safetensors")
    want = load_file(str(tmp_path / "q.safetensors"))
    assert sorted(lazy) == sorted(want) and len(lazy) == len(want)
    for key in ["lm_head.kscale", "layers.0.o_proj.scale", "final_norm",
                "layers.0.o_proj.qweight", "layers.1.down_proj.qweight", "layers.0.input_norm"]:
        got = lazy[key]
        assert got.dtype == want[key].dtype and torch.equal(got, want[key]), key
    assert lazy.get("layers.0.o_proj.zero") is None  # a name the file does not hold
