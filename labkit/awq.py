"""Activation-aware weight quantization (AWQ-style): protect the channels large inputs hit.

A linear's output error from rounding its weights is sum_k x_k * dw_k: an input channel k that
carries large activations multiplies its weights' rounding error by that size. AWQ (Lin et al.,
2023) scales such channels' weights UP by s_k before rounding (they get relatively finer steps)
and the input DOWN by s_k, so that x W^T is unchanged in exact arithmetic:

    x W^T = (x / s) (W * s)^T,   s_k = mean|x_k| ** alpha   (alpha searched in [0, 1] per layer)

The division by s costs nothing at run time: it folds into whatever produced x. Here:
q/k/v and gate/up read an RMSNorm's output (fold into the norm's weight), down_proj reads
silu(gate) * up (fold into up_proj's rows), the output head reads the final norm. o_proj reads
attention outputs whose channels are shared by grouped heads; it keeps plain RTN.
The search runs on activations captured from the fp32 model on a calibration text.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.claims import torch_threads
from labkit.perplexity import CausalAttention
from labkit.quant import QuantScheme, check_fits, fake_quantize, quantize_model, untie_head

GRID = 20  # alpha in 0, 1/GRID, ..., 1: the exercise's search (one small linear)
MODEL_GRID = 10  # a whole model: alpha in 0, 0.1, ..., 1 (a finer grid gained nothing measured)
CALIB_ROWS = 128  # calibration tokens per search
SAMPLE_CHANNELS = 256  # output channels that estimate a linear's error (see search_scale)


@torch.inference_mode()
def capture_inputs(model: nn.Module, ids: torch.Tensor, names: list[str],
                   head_rows: int = CALIB_ROWS) -> dict[str, torch.Tensor]:
    """The input [T, K] that each named nn.Linear sees when the model reads ids [T] (the
    output head sees only the last `head_rows` rows: its 49152 outputs a row are costly)."""
    modules = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}
    hooks = [modules[n].register_forward_hook(
        lambda mod, args, out, n=n: seen.__setitem__(n, args[0].detach().float().clone()))
        for n in names]
    try:
        model(ids, torch.arange(len(ids)), CausalAttention(),
              logit_rows=torch.arange(max(len(ids) - head_rows, 0), len(ids)))
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.inference_mode()
def search_scale(x: torch.Tensor, weights: list[torch.Tensor], scheme: QuantScheme,
                 grid: int = GRID, channels: int | None = None
                 ) -> tuple[torch.Tensor, float, float]:
    """(s [K], error with s, error of plain RTN): the alpha whose scaling best keeps x W^T.

    `channels`: estimate each linear's error on every n-th output channel, about that many
    (each output channel is rounded on its own, so a strided subset gives an unbiased estimate
    of the mean error at a fraction of the cost: the 49152-row head's search drops 100x).
    """
    # x: [T, K] calibration inputs; weights: [N_i, K] linears that read the same x
    act = x.abs().mean(dim=0).clamp(min=1e-5)  # [K] mean input magnitude per channel
    if channels is not None:
        # contiguous: the elementwise ops of every grid point run 5-10x slower on a strided view
        weights = [w[::max(1, w.shape[0] // channels)].contiguous() for w in weights]
    want = [x @ w.t() for w in weights]  # [T, N_i] the fp32 outputs
    best, best_err, rtn_err = torch.ones_like(act), float("inf"), float("inf")
    for i in range(grid + 1):
        alpha = i / grid
        s = act.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 (their range matters)
        err = sum(((x @ (fake_quantize(w * s, scheme) / s).t() - y) ** 2).mean().item()
                  for w, y in zip(weights, want))
        if i == 0:
            rtn_err = err  # alpha = 0: s = 1, plain round-to-nearest
        if err < best_err:
            best, best_err = s, err
    return best, best_err, rtn_err


def awq_scale(x: torch.Tensor, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """The AWQ input-channel scales s [K] for one int4-g`group_size` linear w [N, K] reading x."""
    return search_scale(x, [w], QuantScheme(4, group_size))[0]


@torch.inference_mode()
def apply_awq(model: nn.Module, scheme: QuantScheme, calib_ids: torch.Tensor,
              rows: int = CALIB_ROWS, grid: int = MODEL_GRID, channels: int = SAMPLE_CHANNELS
              ) -> dict[str, tuple[float, float]]:
    """Search and fold AWQ scales into an fp32 model (an untied head); {group: (err, rtn err)}.

    Cost: (grid + 1) fake quantizations of ~`channels` rows per linear, on `rows` tokens.
    """
    names = [f"layers.{i}.{a}" for i in range(len(model.layers))
             for a in ("q_proj", "gate_proj", "down_proj")] + ["lm_head"]
    inputs = capture_inputs(model, calib_ids, names, rows)
    report = {}
    for i, layer in enumerate(model.layers):
        groups = [("q_proj", [layer.q_proj, layer.k_proj, layer.v_proj]),
                  ("gate_proj", [layer.gate_proj, layer.up_proj]),
                  ("down_proj", [layer.down_proj])]
        scales = {}
        for name, lins in groups:  # search every group on the fp32 weights, then fold
            x = inputs[f"layers.{i}.{name}"][-rows:]
            s, err, rtn = search_scale(x, [lin.weight for lin in lins], scheme, grid, channels)
            scales[name], report[f"layers.{i}.{name}"] = s, (err, rtn)
        # fold out of place: the fp32 weights may be shared with other models in the process
        for lin in (layer.q_proj, layer.k_proj, layer.v_proj):
            _set(lin, "weight", lin.weight * scales["q_proj"])
        _set(layer, "input_norm", layer.input_norm / scales["q_proj"])
        for lin in (layer.gate_proj, layer.up_proj):
            _set(lin, "weight", lin.weight * scales["gate_proj"])
        _set(layer, "post_attn_norm", layer.post_attn_norm / scales["gate_proj"])
        _set(layer.down_proj, "weight", layer.down_proj.weight * scales["down_proj"])
        # down reads silu(gate) * up: dividing up's rows divides down's input channels
        _set(layer.up_proj, "weight", layer.up_proj.weight / scales["down_proj"][:, None])
    x = inputs["lm_head"][-rows:]
    s, err, rtn = search_scale(x, [model.lm_head.weight], scheme, grid, channels)
    _set(model.lm_head, "weight", model.lm_head.weight * s)
    _set(model, "final_norm", model.final_norm / s)
    report["lm_head"] = (err, rtn)
    return report


def quantize_awq(model: nn.Module, scheme: QuantScheme | str, calib_ids: torch.Tensor
                 ) -> nn.Module:
    """AWQ then round to nearest: search and fold the scales on calib_ids [T], then
    labkit.quant.quantize_model; in place, returns the model."""
    scheme = QuantScheme.parse(scheme)
    check_fits(model, scheme)  # a group that does not divide a K: refused before the search
    untie_head(model)
    # one thread: the search is thousands of small ops, and each one split over 2 threads waits
    # for the slower; beside one busy core, 2 threads took ~5 min here (1 thread: 12 s, loaded)
    with torch_threads(1):
        apply_awq(model, scheme, calib_ids)
    return quantize_model(model, scheme)


def _set(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace a parameter by a new tensor (never write into the old one)."""
    setattr(module, name, nn.Parameter(value.clone(), requires_grad=False))
