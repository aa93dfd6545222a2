"""labkit's LlamaModel against transformers: same weights, same logits, on ragged packed batches.

labkit runs every sequence of a batch packed into one flat call; transformers runs each sequence
alone. The attention backend here is a reference written below (causal, per sequence, GQA by
repeating K/V heads, fp32), so these tests check the model and the weight conversion, not
labkit.attention.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from labkit.loading import from_hf
from labkit.model import LlamaModel

LENGTHS = (5, 9, 2)  # a ragged batch: three sequences of different lengths, packed end to end


class PackedCausalAttention:
    """Reference attention for a packed batch of new sequences (no KV cache), fp32."""

    def __init__(self, lengths: tuple[int, ...]):
        self.lengths = lengths

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D] with T = sum(lengths)
        group = q.shape[1] // k.shape[1]
        out, start = [], 0
        for n in self.lengths:
            qs = q[start:start + n].float()  # [n, H, D]
            ks = k[start:start + n].float().repeat_interleave(group, dim=1)  # [n, H, D]
            vs = v[start:start + n].float().repeat_interleave(group, dim=1)  # [n, H, D]
            scores = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(q.shape[-1])  # [H, n, n]
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            out.append(torch.einsum("hqk,khd->qhd", probs, vs).to(q.dtype))  # [n, H, D]
            start += n
        return torch.cat(out)  # [T, H, D]


def labkit_logits(model: LlamaModel, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits of every token of every sequence, from one packed forward call."""
    ids = torch.cat(seqs)  # [T]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])  # [T]: each restarts at 0
    attn = PackedCausalAttention(tuple(len(s) for s in seqs))
    logits = model(ids, positions, attn)  # [T, V]
    return list(logits.split([len(s) for s in seqs]))


@torch.no_grad()
def hf_logits(hf, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits of every token, transformers running each sequence on its own."""
    return [hf(s[None]).logits[0].float() for s in seqs]


def random_seqs(vocab: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights of a realistic scale, biases and norms included (their init is 0 or 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, attn_implementation="eager")


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-qkv-gate-up"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiny_random_matches_transformers_on_ragged_batch(family, fused):
    if family == "llama":  # tied head, no bias
        hf = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True))
    else:  # q/k/v bias, untied head, another rope theta
        hf = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 50000.0}))
    randomize(hf, seed=0)
    hf.eval()
    model = from_hf(hf)
    if fused:  # q|k|v and gate|up as one linear each (labkit.model.concat_linears)
        model.fuse_projections()
    assert model.cfg.attention_bias == (family == "qwen2")
    assert model.cfg.tie_embeddings == (family == "llama")
    seqs = random_seqs(TINY["vocab_size"], seed=1)
    worst = 0.0
    for i, (ours, ref) in enumerate(zip(labkit_logits(model, seqs), hf_logits(hf, seqs))):
        err = (ours - ref).abs().max().item()
        worst = max(worst, err)
        # fp32, same weights: only summation order differs; logits are O(1)
        assert err < 1e-4, f"{family}: sequence {i} (length {LENGTHS[i]}) max |dlogit| = {err:.2e}"
    print(f"tiny {family} ragged parity: max |dlogit| = {worst:.2e}")


# --- the real model --------------------------------------------------------------------------

# labkit name -> transformers name, written out here as the reference for the conversion
HF_LAYER = {"input_norm": "input_layernorm.weight",
            "post_attn_norm": "post_attention_layernorm.weight",
            "q_proj.weight": "self_attn.q_proj.weight", "k_proj.weight": "self_attn.k_proj.weight",
            "v_proj.weight": "self_attn.v_proj.weight", "o_proj.weight": "self_attn.o_proj.weight",
            "gate_proj.weight": "mlp.gate_proj.weight", "up_proj.weight": "mlp.up_proj.weight",
            "down_proj.weight": "mlp.down_proj.weight"}


def to_transformers(model: LlamaModel) -> LlamaForCausalLM:
    """A transformers LlamaForCausalLM holding exactly labkit's weights."""
    cfg = model.cfg
    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    state = {}
    for name, w in model.state_dict().items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            state[f"model.layers.{i}.{HF_LAYER[rest]}"] = w
        else:
            state[{"embed.weight": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                   "lm_head.weight": "lm_head.weight"}[name]] = w
    # from a state dict, transformers builds on the meta device: no seconds of random init
    return LlamaForCausalLM.from_pretrained(None, config=config, state_dict=state,
                                            dtype=torch.float32,
                                            attn_implementation="eager").eval()


@pytest.mark.slow
def test_smollm2_matches_transformers_on_ragged_batch(smollm2):
    model, tok = smollm2
    hf = to_transformers(model)
    prompts = ["The capital of France is", "Once upon a time, in a land far, far away,", "Hi there"]
    seqs = [torch.tensor(tok.encode(p)) for p in prompts]
    seqs = [s[:n] for s, n in zip(seqs, LENGTHS)]
    assert [len(s) for s in seqs] == list(LENGTHS)
    worst = 0.0
    for i, (ours, ref) in enumerate(zip(labkit_logits(model, seqs), hf_logits(hf, seqs))):
        err = (ours - ref).abs().max().item()
        worst = max(worst, err)
        # fp32, 30 layers, logits of magnitude ~20: summation order costs ~1e-5
        assert err < 1e-3, f"sequence {i} (length {LENGTHS[i]}) max |dlogit| = {err:.2e}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)), f"sequence {i}: greedy tokens differ"
    print(f"SmolLM2 ragged parity: max |dlogit| = {worst:.2e}")


@pytest.mark.slow
def test_smollm2_gguf_weights_match_transformers_own_gguf_decoding(smollm2):
    """Dequantization and the Q/K un-permutation, against transformers' own GGUF code."""
    from transformers.integrations.gguf.dequant import dequantize
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from labkit.utils.cache import packaged_gguf

    model, _ = smollm2
    cfg = model.cfg
    ours = model.state_dict()
    header = GgufHeader.from_file(str(packaged_gguf()))
    lazy = load_gguf_state_dict(header)
    unpermute = LlamaTensorProcessor(config={"num_attention_heads": cfg.num_heads,
                                             "num_key_value_heads": cfg.num_kv_heads})
    # every permuted tensor (q, k of all layers), plus one of each other kind and quant type
    gguf_to_ours = {f"blk.{i}.attn_{x}.weight": f"layers.{i}.{x}_proj.weight"
                    for i in range(cfg.num_layers) for x in "qk"}
    gguf_to_ours.update({"blk.3.attn_v.weight": "layers.3.v_proj.weight",
                         "blk.3.ffn_down.weight": "layers.3.down_proj.weight",
                         "blk.3.attn_norm.weight": "layers.3.input_norm",
                         "output_norm.weight": "final_norm"})
    for gname, name in gguf_to_ours.items():
        info = next(t for t in header.tensors if t.name == gname)
        raw = lazy[gname][...]
        w = raw.float() if raw.is_floating_point() else dequantize(raw, info.ggml_type)
        w = torch.from_numpy(unpermute.process(weights=w.reshape(info.shape).numpy(),
                                               name=gname).weights.copy())
        assert torch.equal(w, ours[name]), (
            f"{gname} -> {name}: differs from transformers' decoding by "
            f"{(w - ours[name]).abs().max().item():.2e} (check the dequantization or unpermute_qk)")
    # the embedding is Q8_0 and large: its first 64 rows are enough to check that format
    info = next(t for t in header.tensors if t.name == "token_embd.weight")
    rows = dequantize(lazy["token_embd.weight"][...][:64], info.ggml_type).reshape(64, -1)
    assert torch.equal(rows, ours["embed.weight"][:64]), "token_embd (Q8_0) decodes differently"
