"""The decoder's layers in one C++ call (`decoder_stack.cpp`), where labkit's kernels serve.

At batch 1 a SmolLM2 int4 forward spent about a third of its time in Python between the
kernels: ~20 calls, slices, views and module attribute lookups per layer, 30 layers. A
`DecoderStack` holds every layer's weights (the modules' own tensors, by reference) and runs
`DecoderLayer.forward` op for op in C++, over the same kernels and aten calls in the same order,
so its outputs are the Python path's, bit for bit (tests/test_decoder_stack.py). The Python
layers stay the readable reference, and what runs wherever the stack does not serve: a model
whose linears are not fp32 `nn.Linear` or labkit's quantized kernels, an attention backend
without a CPU kernel (naive attention, a bf16 pool), a CUDA tensor, a torch mode (tracing, the
tests' fake CUDA), no compiler, or `LABKIT_DECODER_STACK=0`.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

from labkit.kernels import cpu as cpu_kernels

_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (key, stack, edits)
# Every module registration in the process (a submodule set, replaced or added: what
# quantize_model, fuse_projections or a hand-made swap do) counts here; a stack's key is read
# again only when the count moved since it was last checked. Reading it every forward cost
# ~50 us at batch 1: 30 layers' dicts, on caches the weights just swept (~5 us when hot).
_EDITS = [0]


def _count_edit(module, name, submodule) -> None:
    _EDITS[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_edit)
_state = {"enabled": os.environ.get("LABKIT_DECODER_STACK", "1") != "0", "profile": False,
          "split": [0.0, 0.0, 0.0]}
SPLIT = ("linears", "attention", "row ops")  # DecoderStack.kernel_split's kinds, in its order
_KINDS = {"int8_linear": 1, "int4_linear": 2, "int4_linear_dot": 3,  # decoder_stack.cpp
          "int8_linear_dot": 4}
_LINEARS = ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "gate_proj",
            "up_proj", "down_proj")
_NONE = torch.empty(0)


def enabled() -> bool:
    """Whether models may run their layers through the stack."""
    return _state["enabled"]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the block with every model on its Python layers (to compare the two)."""
    before = _state["enabled"]
    _state["enabled"] = False
    try:
        yield
    finally:
        _state["enabled"] = before


def _linear_args(lin: nn.Module | None) -> tuple | None:
    """(kind, a, b, bias) of one linear for decoder_stack.cpp; kind -1 for an absent one; None
    if the stack cannot run it."""
    if lin is None:
        return (-1, _NONE, _NONE, _NONE)
    bias = _NONE if lin.bias is None else lin.bias
    if type(lin) is nn.Linear:
        return (0, lin.weight, _NONE, bias)
    kernel = getattr(lin, "_labkit_kernel", None)
    if kernel not in _KINDS:
        return None
    a, b = (lin.qweight, lin.scale) if kernel == "int8_linear" else (lin.kweight, lin.kscale)
    return (_KINDS[kernel], a, b, bias)


def _build(model, module):
    """A DecoderStack of `model`'s layers, or None if one of its linears has no C++ path."""
    cfg = model.cfg
    stack = module.DecoderStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                cfg.intermediate_size, cfg.rms_norm_eps)
    for layer in model.layers:
        lins = [_linear_args(getattr(layer, name, None)) for name in _LINEARS]
        if any(x is None for x in lins):
            return None
        stack.add_layer(layer.input_norm, layer.post_attn_norm, lins)
    # the ends (for_logits), where the head has a C++ path: tied, the embedding itself
    head = ((0, model.embed.weight, _NONE, _NONE) if model.lm_head is None
            else _linear_args(model.lm_head))
    if head is not None and head[0] >= 0:
        stack.set_ends(model.embed.weight, model.final_norm, head)
    return stack


def supports(model) -> bool:
    """Whether every linear of `model` has a C++ path (a stack would serve its forward where
    labkit's kernels and the attention backend's do)."""
    return all(_linear_args(getattr(layer, n, None)) is not None
               for layer in model.layers for n in _LINEARS)


def _key(model) -> list[tuple]:
    """What the stack was built from: every layer's submodules (a replaced module, a quantized
    or fused model needs a new stack), and the model's own (the embedding, the head). Read
    after any module registration (`_EDITS`), so it must be cheap: ~10 us for 30 layers, where
    reading each linear by name took ~0.3 ms."""
    return [tuple(model._modules.values())] + [tuple(layer._modules.values())
                                                for layer in model.layers]


def forget(model) -> None:
    """Drop `model`'s stack, if built: the next forward builds one from the tensors the model
    holds then (after `labkit.utils.pages.place_weights` moved them)."""
    _STACKS.pop(model, None)


def _served(model, x: torch.Tensor, attn) -> tuple | None:
    """(the stack, the attention's arguments) where the stack serves a forward of `model` on
    x-like tensors (fp32 CPU) with `attn`, else None."""
    if not _state["enabled"] or cpu_kernels.usable(x) is None:
        return None
    args_of = getattr(attn, "stack_args", None)
    args = args_of(x) if args_of is not None else None
    if args is None:
        return None
    entry = _STACKS.get(model)
    if entry is None or entry[2] != _EDITS[0]:  # new, or modules registered since: re-check
        key = _key(model)
        if entry is None or entry[0] != key:
            entry = (key, _build(model, cpu_kernels.kernels()), _EDITS[0])
        else:
            entry = (key, entry[1], _EDITS[0])
        _STACKS[model] = entry
    return None if entry[1] is None else (entry[1], args)


def for_step(model, x: torch.Tensor, attn) -> Callable | None:
    """The call that runs all of `model`'s layers on `x` ([T, d], fp32 CPU) with `attn`, or None
    where the stack does not serve this forward (the caller runs its Python layers)."""
    served = _served(model, x, attn)
    if served is None:
        return None
    stack, args = served

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        profile = _state["profile"]
        out = stack.forward(x, cos, sin, *args, profile)
        if profile:
            _count(stack)
        return out

    return run


def _hooked(module: nn.Module | None) -> bool:
    return module is not None and bool(module._forward_hooks or module._forward_pre_hooks)


def for_logits(model, attn) -> Callable | None:
    """The call that runs `model`'s whole forward (LlamaModel.forward: the embedding, every
    layer, the rows wanted, the final norm, the head) in C++ with `attn`, or None where the
    stack does not serve it: then `for_step` may still serve the layers. Not where the
    embedding or the head has hooks (the Python path calls them as modules, so hooks run)."""
    if _hooked(model.embed) or _hooked(model.lm_head):
        return None
    served = _served(model, model.embed.weight, attn)  # the embedding's rows are like it
    if served is None or not served[0].has_ends():
        return None
    stack, args = served

    def run(ids: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
            positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        # RoPE's rows are copied from the tables (labkit.model.rope_table) inside the call; a
        # position outside them is an IndexError raised before anything runs
        profile = _state["profile"]
        out = stack.logits(ids, cos_table, sin_table, positions, *args, rows, profile)
        if profile:
            _count(stack)
        return out

    return run


def _count(stack) -> None:
    """Adds the last stack call's kernel seconds, by kind, to the profile's."""
    _state["split"] = [a + b for a, b in zip(_state["split"], stack.kernel_split())]


@contextlib.contextmanager
def profiling() -> Iterator[dict]:
    """Time the kernels inside every stack call of the block: yields a dict whose "kernel_s"
    holds, after the block, the seconds they took (the rest of a forward is what ran between
    them), and whose "split" holds those seconds by kind ({name in SPLIT: seconds}: the
    linears, the head among them; attention, with its KV write; the row ops: norms, residual
    adds, RoPE, SiLU times up)."""
    out = {"kernel_s": 0.0, "split": dict.fromkeys(SPLIT, 0.0)}
    _state["profile"], _state["split"] = True, [0.0] * len(SPLIT)
    try:
        yield out
    finally:
        _state["profile"] = False
        out["split"] = dict(zip(SPLIT, _state["split"]))
        out["kernel_s"] = sum(_state["split"])
