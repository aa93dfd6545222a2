"""The whole engine: every chapter's feature as one switch, and the ablation that turns each off.

Each chapter added one mechanism to the engine; this module names them together:

| feature               | chapter | switch (on / off)                                           |
| --------------------- | ------- | ----------------------------------------------------------- |
| continuous batching   | 02      | `batching="continuous"` / `"static"`                        |
| chunked prefill       | 02      | `max_step_tokens=512` / `None` (a whole prompt per launch)  |
| quantized weights     | 03      | `quant="int8"` (or `"int4-g64"`, ...) / `None` (fp32)       |
| flash attention       | 04      | `attention="flash"` / `"paged"`                             |
| pages on demand       | 05      | `kv_reserve="on_demand"` / `"max"` (prompt + max_new)       |
| prefix sharing        | 05      | `prefix_caching=True` / `False`                             |
| pipelined decoder     | 07      | `decoder="pipelined"` / `"blocking"`                        |

`EngineSetup.whole()` has them all on; `EngineSetup.plain()` all off (static batching, whole
prompts, fp32, naive attention, max-length reservation, no sharing, the blocking loop: what a
first engine does). `setup.without(feature)` turns one off: the ablation's rows. Greedy and in
fp32, every setup emits the same tokens (tests/test_capstone.py holds this); quantization alone
changes them, within the error chapter 03 states.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from labkit.engine import Engine
from labkit.loading import load_model
from labkit.quant import QuantScheme, quantize_model
from labkit.utils.pages import place_weights

# feature -> (the EngineSetup field, its value when the feature is off)
FEATURES: dict[str, tuple[str, object]] = {
    "continuous batching": ("batching", "static"),
    "chunked prefill": ("max_step_tokens", None),
    "quantized weights": ("quant", None),
    "flash attention": ("attention", "paged"),
    "pages on demand": ("kv_reserve", "max"),
    "prefix sharing": ("prefix_caching", False),
    "pipelined decoder": ("decoder", "blocking"),
}


@dataclass(frozen=True)
class EngineSetup:
    """One engine configuration: every feature's switch, validated at construction."""

    batching: str = "continuous"
    max_step_tokens: int | None = 512  # tokens per launch (decode rows + prefill chunks)
    quant: str | None = "int8"  # a labkit.quant scheme name; None: fp32 weights
    attention: str = "flash"
    kv_reserve: str = "on_demand"
    prefix_caching: bool = True
    decoder: str = "pipelined"

    def __post_init__(self) -> None:
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.max_step_tokens is not None and (
                isinstance(self.max_step_tokens, bool) or not isinstance(self.max_step_tokens, int)
                or self.max_step_tokens < 1):
            raise ValueError(f"max_step_tokens must be an int >= 1 or None, got "
                             f"{self.max_step_tokens!r}")
        scheme = QuantScheme.parse(self.quant)  # raises on an unknown scheme
        object.__setattr__(self, "quant", scheme.name if scheme else None)
        if self.attention not in ("naive", "paged", "flash"):
            raise ValueError(f"attention must be naive, paged or flash, got {self.attention!r}")
        if self.kv_reserve not in ("on_demand", "max"):
            raise ValueError(f"kv_reserve must be 'on_demand' or 'max', got {self.kv_reserve!r}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be a bool, got {self.prefix_caching!r}")
        if self.decoder not in ("blocking", "pipelined"):
            raise ValueError(f"decoder must be blocking or pipelined, got {self.decoder!r}")

    @staticmethod
    def whole(quant: str | None = "int8") -> EngineSetup:
        """Every feature on (`quant=None` keeps fp32 weights: the token-for-token check)."""
        return EngineSetup(quant=quant)

    @staticmethod
    def plain() -> EngineSetup:
        """Every feature off: a first engine (naive attention rather than paged)."""
        return dataclasses.replace(EngineSetup().without(*FEATURES), attention="naive")

    def without(self, *features: str) -> EngineSetup:
        """This setup with `features` (names of FEATURES) turned off."""
        changes = {}
        for name in features:
            if name not in FEATURES:
                raise ValueError(f"unknown feature {name!r}: one of {', '.join(FEATURES)}")
            attr, off = FEATURES[name]
            changes[attr] = off
        return dataclasses.replace(self, **changes)

    def off(self) -> list[str]:
        """The features this setup has turned off."""
        return [name for name, (attr, value) in FEATURES.items()
                if getattr(self, attr) == value
                or (attr == "attention" and self.attention != "flash")]  # naive is off too

    def engine_kwargs(self) -> dict:
        """The Engine keyword arguments of this setup (the decoder and weights are apart)."""
        return {"batching": self.batching, "max_step_tokens": self.max_step_tokens,
                "attention": self.attention, "kv_reserve": self.kv_reserve,
                "prefix_caching": self.prefix_caching,
                # the pipelined loop plans around finishes by length (no zombie row for them)
                "foresee_finishes": self.decoder == "pipelined"}

    def build(self, model, tokenizer=None, *, quantized: dict | None = None,
              **engine_kwargs) -> Engine:
        """An Engine of this setup over `model`, an fp32 model: quantized here if the setup
        says so (a copy: `model` stays as it is). Every setup runs q|k|v and gate|up fused, as
        the engine's entry points load models: an fp32 model given per projection (the form
        quantizing needs) runs as a fused copy. `quantized` ({scheme, or None for that fp32
        copy: model}) keeps each copy made, so that setups of one scheme share one copy of the
        weights (an engine never writes its model). `engine_kwargs`: kv_tokens, device, ..."""
        cache = quantized if quantized is not None else {}
        if self.quant is not None or any(layer.qkv_proj is None for layer in model.layers):
            if self.quant not in cache:  # quantization replaces the linears in place
                made = quantize_model(copy.deepcopy(model), self.quant)  # (None: a plain copy)
                made.fuse_projections()  # q|k|v, gate|up: as load_model has them
                place_weights(made)  # in 2 MiB pages, as load_model places models
                cache[self.quant] = made
            model = cache[self.quant]
        return Engine(model, tokenizer, **self.engine_kwargs(), **engine_kwargs)

    def load(self, name: str = "smollm2-135m", **engine_kwargs) -> Engine:
        """An Engine of this setup over a model by name (`load_model`: its quantized weights
        come from the model cache)."""
        model, tok = load_model(name, quant=self.quant, fuse=True)
        return Engine(model, tok, **self.engine_kwargs(), **engine_kwargs)
