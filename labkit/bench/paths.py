"""Which kernel each op of a model's step runs on, and why: so that a figure measured on
another CPU can be explained (`bench step` and `bench generate` print it).

labkit's C++ kernels (`labkit.kernels.cpu`) serve fp32 activations on a CPU where they built;
elsewhere torch serves: its packed kernels for int8, the dequantize-then-matmul reference for
labkit's int4 layouts, aten ops for the norms, RoPE and attention.
"""

from __future__ import annotations

from collections import Counter

import torch

from labkit.kernels import cpu as cpu_kernels


def kernel_paths(model, attention: str, device: str = "cpu") -> list[tuple[str, str]]:
    """[(op, path)] for one step of `model` with the `attention` backend on `device`."""
    from labkit.quant import QuantLinear

    dtype = next(model.parameters()).dtype
    on_cpu = device == "cpu" and dtype is torch.float32
    built = cpu_kernels.kernels() if on_cpu else None
    why = (cpu_kernels.status() if device == "cpu" and dtype is torch.float32
           else f"{device} {str(dtype).removeprefix('torch.')}: labkit's C++ serves fp32 CPU")
    labkit = f"labkit C++ ({cpu_kernels.status()})" if built is not None else None
    linears: Counter[str] = Counter()
    # fp32 weights: labkit's few-row kernel up to its row count (decode, a verify), then torch's
    fp32 = (f"{labkit} fp32_linear (steps of up to {built.FP32_KERNEL_ROWS} rows; torch "
            "matmul beyond)" if labkit is not None else f"torch matmul ({why})")
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            name = mod._labkit_kernel
            if name == "int8_linear" and labkit is not None:  # its arithmetic, by the build
                linears[f"{labkit} int8_linear " + ("on vpdpwssd (x as int16)"
                                                    if built.has_int8_dot()
                                                    else "(codes to fp32)")] += 1
            elif name == "int8_linear_dot" and labkit is not None:
                linears[f"{labkit} int8_linear_dot on vpdpbusd (x as int16 in two bytes), "
                        "the codes in blocks of 16 rows"] += 1
            elif name == "int4_linear_dot" and labkit is not None:
                linears[f"{labkit} int4_linear_dot on vpdpbusd (x as int16)"] += 1
            elif name is not None and labkit is not None:
                linears[f"{labkit} {name}"] += 1
            elif mod.scheme.bits == 8 and name != "int8_linear_dot":
                linears[f"torch _weight_int8pack_mm ({why})"] += 1
            else:
                linears[f"torch dequantize-then-matmul ({why})"] += 1
        elif isinstance(mod, torch.nn.Linear):
            linears[fp32] += 1
    if getattr(model, "lm_head", False) is None:  # tied: the head is the embedding matrix
        linears[fp32] += 1
    out = [(f"linear x{n}", path) for path, n in sorted(linears.items())]
    row_ops = labkit or f"torch aten ops ({why})"
    out += [("rms_norm, rope, silu_mul", row_ops)]
    if attention in ("paged", "flash"):
        att = f"{labkit} {attention}_attention" if labkit else (
            "Python tiles (FlashAttention.reference)" if attention == "flash"
            else "gather then torch SDPA") + f" ({why})"
    else:
        att = "torch matmul and softmax (the naive reference)"
    out.append(("attention", att))
    from labkit.kernels import stack as decoder_stack

    if labkit is None or attention not in ("paged", "flash"):
        layers = "Python, op by op (DecoderLayer.forward): labkit's C++ does not serve here"
    elif not decoder_stack.enabled():
        layers = "Python, op by op (DecoderLayer.forward): LABKIT_DECODER_STACK=0"
    elif decoder_stack.supports(model):
        layers = f"{labkit} DecoderStack: every layer in one call"
    else:
        layers = "Python, op by op (DecoderLayer.forward): a linear the C++ stack cannot run"
    out.append(("the layers", layers))
    out.append(("the weights", weight_pages(model)))
    return out


def weight_pages(model) -> str:
    """The pages `model`'s weights sit in (labkit.utils.pages: what `load_model` placed)."""
    from labkit.utils import pages

    where = pages.placement(model)
    if not where["placed"]:
        small = where["bytes"] < pages.MIN_BYTES
        why = pages.huge_pages() or (f"under {pages.MIN_BYTES >> 20} MiB, left as they are"
                                     if small else "not placed: labkit.utils.pages.place_weights")
        return f"{where['bytes'] / 1e6:.0f} MB as allocated, in 4 KiB pages ({why})"
    return (f"{where['placed'] / 1e6:.0f} of {where['bytes'] / 1e6:.0f} MB in the step's order "
            f"in labkit's buffers, {where['huge_bytes'] / 1e6:.0f} MB of them in 2 MiB pages "
            "(labkit.utils.pages)")


def format_paths(paths: list[tuple[str, str]]) -> str:
    """The paths as lines for a benchmark's output."""
    width = max(len(op) for op, _ in paths)
    return "\n".join(f"  {op:<{width}}  {path}" for op, path in paths)
