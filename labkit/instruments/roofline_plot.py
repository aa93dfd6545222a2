"""Pictures of the roofline: the roofs of one or more chips, and ops and steps placed on them.

On log-log axes a chip's roof is a slanted line (memory-bound: FLOP/s = intensity x bandwidth)
that meets a flat one (compute-bound: the peak) at the ridge point. `plot_roofline` draws the
roofs of the chips it is given and places ops on them: measured ones at the FLOP/s they achieved
(filled), predicted ones, counted by `labkit/roofline.py`, on the roof (open). `explore` is the
same plot behind widgets: chip, model, batch, context and dtypes. matplotlib and ipywidgets are
imported only when something is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.ceilings import resolve_hardware
from labkit.model import PRESETS
from labkit.roofline import (
    HARDWARE,
    Hardware,
    OpCost,
    StepCost,
    _compute_dtype,
    _hw_key,
    step_cost,
)


@dataclass(frozen=True)
class RooflinePoint:
    """A point to place on the plot: a measured op (achieved FLOP/s) or a predicted one."""

    label: str
    intensity: float  # FLOP/byte
    flops_per_s: float
    measured: bool = True

    @staticmethod
    def timed(op: OpCost, seconds: float, label: str | None = None) -> RooflinePoint:
        """An op that ran in `seconds`: achieved FLOP/s = its FLOPs / seconds."""
        return RooflinePoint(label or op.name, op.intensity, op.flops / seconds, True)


def plot_roofline(hardware: Hardware | str | Sequence[Hardware | str],
                  points: Sequence[RooflinePoint | OpCost | StepCost] = (), dtype: str = "bf16",
                  ax=None, title: str | None = None):
    """Draw the roofs of one or more chips, their ridges, and ops/steps placed on them."""
    import matplotlib.pyplot as plt

    chips = [resolve_hardware(h) for h in (
        [hardware] if isinstance(hardware, (str, Hardware)) else hardware)]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 5))
    placed = []
    for p in points:  # a predicted step sits on its own chip's roof; a bare op on the first
        if isinstance(p, RooflinePoint):
            placed.append(p)
        elif isinstance(p, StepCost):
            label = f"{p.phase} B={p.batch} L={p.context_len}"
            placed.append(RooflinePoint(label, p.intensity,
                                        min(p.peak_flops, p.intensity * p.bandwidth), False))
        else:
            placed.append(RooflinePoint(p.name, p.intensity, p.attainable(chips[0]), False))
    xs = [p.intensity for p in placed] + [hw.ridge(_has(hw, dtype)) for hw in chips]
    lo, hi = min(xs + [1.0]) / 4, max(xs + [1.0]) * 4
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, hw in enumerate(chips):
        dt, color = _has(hw, dtype), colors[i % len(colors)]
        ridge, peak = hw.ridge(dt), hw.peak(dt)
        ax.loglog([lo, ridge, hi], [lo * hw.bandwidth, peak, peak], color=color, lw=2,
                  label=f"{hw.name}: {_si(peak, 'FLOP/s')} {dt}, {_si(hw.bandwidth, 'B/s')}")
        ax.axvline(ridge, color=color, ls=":", lw=1)
        # along the ridge line, at the bottom of the plot: points sit on the roofs, far above
        ax.annotate(f"ridge {ridge:.3g}", (ridge, 0), xycoords=("data", "axes fraction"),
                    textcoords="offset points", xytext=(-3, 4), color=color, fontsize=8,
                    rotation=90, ha="right", va="bottom")
    prev, level = None, 0
    for p in sorted(placed, key=lambda q: q.intensity):
        ax.plot(p.intensity, p.flops_per_s, "o" if p.measured else "s", ms=7,
                mfc="black" if p.measured else "white", mec="black")
        # a label near the last one (within ~4x on both axes) moves one line down
        near = prev is not None and math.log10(p.intensity / prev.intensity) < 0.6 and abs(
            math.log10(p.flops_per_s / prev.flops_per_s)) < 0.6
        level = level + 1 if near else 0
        right = p.intensity > hi / 20  # near the right edge: write the label leftwards
        ax.annotate(p.label, (p.intensity, p.flops_per_s), textcoords="offset points",
                    xytext=(-6 if right else 6, -12 - 11 * level), fontsize=8,
                    ha="right" if right else "left")
        prev = p
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or "roofline (filled: measured; open: predicted, on the roof)")
    ax.legend(fontsize=8, loc="upper left")  # the roofs leave that corner empty
    ax.grid(True, which="both", alpha=0.2)
    return ax


def _si(value: float, unit: str) -> str:
    """3 significant digits with an SI prefix: 989.5e12 FLOP/s -> '990 TFLOP/s'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _has(hw: Hardware, dtype: str) -> str:
    """dtype if the chip has a peak for it, else its fastest float format."""
    return dtype if dtype in hw.peak_flops else _compute_dtype(hw, "int8")


def explore(hardware: str = "H200", model: str = "smollm2-135m"):
    """An interactive roofline: pick chip, model, batch, context, dtypes; see the step time."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import display

    dtypes = ["bf16", "fp16", "fp8", "int8", "int4", "fp4", "fp32"]
    controls = {
        "hardware": widgets.Dropdown(options=[*HARDWARE, "this"], description="hardware",
                                     value=_hw_key(hardware) if hardware in HARDWARE else "this"),
        "model": widgets.Dropdown(options=list(PRESETS), value=model, description="model"),
        "phase": widgets.ToggleButtons(options=["decode", "prefill"], value="decode"),
        "batch": widgets.SelectionSlider(options=[2**i for i in range(11)], value=1,
                                         description="batch"),
        "context": widgets.SelectionSlider(options=[2**i for i in range(7, 18)], value=1024,
                                           description="context"),
        "weight_dtype": widgets.Dropdown(options=dtypes, value="bf16", description="weights"),
        "kv_dtype": widgets.Dropdown(options=dtypes, value="bf16", description="KV"),
    }
    out = widgets.Output()

    def redraw(_=None) -> None:
        v = {name: c.value for name, c in controls.items()}
        with out:
            out.clear_output(wait=True)
            try:
                cost = step_cost(PRESETS[v["model"]](), v["batch"], v["context"], v["phase"],
                                 v["weight_dtype"], v["kv_dtype"], hardware=v["hardware"])
            except (KeyError, ValueError) as err:
                print(f"cannot predict this step: {err}")
                return
            fig, ax = plt.subplots(figsize=(7.5, 4.5))
            plot_roofline(resolve_hardware(v["hardware"]), [cost], dtype=cost.compute_dtype, ax=ax)
            display(fig)
            plt.close(fig)
            print(cost.summary())

    for c in controls.values():
        c.observe(redraw, names="value")
    redraw()
    c = controls
    return widgets.VBox([
        widgets.HBox([c["hardware"], c["model"], c["phase"]]),
        widgets.HBox([c["batch"], c["context"]]),
        widgets.HBox([c["weight_dtype"], c["kv_dtype"]]), out])
