"""Choosing the next token, on the device, reproducibly.

`SamplingParams` says how a request wants its tokens chosen. `sample()` turns a batch of logits
into one token per row without leaving the device: greedy rows take the argmax; sampled rows are
scaled by their temperature, cut by top-k and top-p, and drawn with the Gumbel-max trick,
`argmax(logits + Gumbel noise)`, which samples exactly from softmax(logits).

The noise is not drawn from a global generator. It is a hash of (request seed, token index,
vocabulary id), so a request's tokens depend only on its own seed and its own history: the same
request gives the same tokens alone or in any batch, in the blocking or the pipelined decoder,
and on any device. (A shared `torch.Generator` would hand each request whatever numbers were left
after the rows before it.)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).smallest_subnormal)
# below this a temperature is refused: logits of magnitude up to ~1e32 divided by it still fit
# in float32 (the largest is 3.4e38); 1e-6 is already greedy in all but exact ties
MIN_TEMPERATURE = 1e-6


def _is_int(x) -> bool:
    """An integer that is not a bool (JSON `true` must not pass as 1)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    """A real number that is not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen; validates itself."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_k: int | None = None  # None: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # token ids that end the request, besides the model's EOS
    ignore_eos: bool = False  # benchmarks: run to max_new_tokens whatever is sampled

    def __post_init__(self) -> None:
        # bool is an int in Python, and JSON's `true` arrives as one: never a number here
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got "
                             f"{self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not self.temperature >= 0:  # rejects NaN too
            raise ValueError(f"temperature must be >= 0 (0 is greedy) and a number, got "
                             f"{self.temperature!r}")
        with np.errstate(over="ignore"):
            t32 = float(np.float32(self.temperature))
        if not math.isfinite(t32):  # inf, or too large for float32 (1e39 becomes inf)
            raise ValueError(f"temperature {self.temperature} is not a finite float32 (at most "
                             f"{FLOAT32_MAX:.3g}); for a near-uniform draw use e.g. 100")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature {self.temperature} is below {MIN_TEMPERATURE}: "
                             "float32 logits divided by it overflow; use 0 for greedy")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an integer >= 1, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] and a number, got {self.top_p!r}")
        if np.float32(self.top_p) == 0:
            raise ValueError(f"top_p {self.top_p} rounds to 0 in float32 (the device's "
                             f"precision); the smallest usable is about {FLOAT32_TINY:.3g}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63) and an integer, got {self.seed!r}")
        if not all(_is_int(i) and i >= 0 for i in self.stop_ids):
            raise ValueError(f"stop_ids must be token ids (integers >= 0), got "
                             f"{self.stop_ids!r}")
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
        for name in ("max_new_tokens", "seed") + (("top_k",) if self.top_k is not None else ()):
            object.__setattr__(self, name, int(getattr(self, name)))  # numpy ints -> int

    @property
    def greedy(self) -> bool:
        """True when the argmax is taken (temperature 0)."""
        return self.temperature == 0


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, as device tensors."""

    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] long; V = no cut
    top_p: torch.Tensor  # [B] float
    seed: torch.Tensor  # [B] long
    counter: torch.Tensor  # [B] long: index of the token being chosen (its output position)
    # known on the host when the batch is built, so no device sync is needed to skip work
    all_greedy: bool = False  # no row samples
    any_top_k: bool = True  # some row cuts by top-k
    any_top_p: bool = True  # some row cuts by top-p

    @staticmethod
    def build(params: list[SamplingParams], counters: list[int], vocab_size: int,
              to_device=torch.tensor) -> SamplingBatch:
        """Pack each row's params and token counter into tensors (`to_device`: list -> tensor)."""
        return SamplingBatch(
            temperature=to_device([float(p.temperature) for p in params]),
            # top_k above the vocabulary keeps everything: clamped, or a batch-mate's real cut
            # would index past the end of the sorted row
            top_k=to_device([min(p.top_k or vocab_size, vocab_size) for p in params]),
            top_p=to_device([float(p.top_p) for p in params]),
            seed=to_device([p.seed for p in params]),
            counter=to_device(counters),
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(p.top_k is not None and p.top_k < vocab_size for p in params),
            any_top_p=any(p.top_p < 1 for p in params))


_M32 = 0xFFFFFFFF


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the same 32 bits as int32."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _signed(c: int) -> int:
    """A 32-bit constant as the int32 with the same bits."""
    return c - 2**32 if c >= 2**31 else c


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) on int32 tensors, bit for bit the unsigned one.

    int32 holds the same 32 bits as the unsigned value: xor and a wrapping multiply act on bits
    alike, and `(x >> s) & mask` is the unsigned (logical) shift. Half the memory traffic of
    int64, which on a CPU device made the noise of a [32, 8192] batch ~5x cheaper.
    """
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D  # wraps modulo 2**32, as the unsigned product would
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * 0x2C1B3C6D
    return x ^ ((x >> 16) & 0xFFFF)


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise [B, V] that depends only on (seed, counter, vocab id)."""
    # seed, counter: [B] int64
    # seed and counter enter through different constants, so (s, c) and (c, s) differ
    lo, hi = _as_int32(seed & _M32), _as_int32((seed >> 32) & _M32)
    key = _mix32(_mix32(lo ^ 0x243F6A88) ^ hi)
    key = _mix32(key ^ _mix32(_as_int32(((counter & _M32) + 0x6A09E667) & _M32)))  # [B]
    vocab = torch.arange(vocab_size, device=seed.device, dtype=torch.int32)
    h = _mix32(key[:, None] + vocab[None, :] * _signed(0x9E3779B1))  # [B, V]
    return hash_to_unit(h)


def hash_to_unit(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int32) -> float32 strictly inside (0, 1), every one of them.

    The top 23 bits m give (m + 0.5) / 2^23: m + 0.5 < 2^23 needs 24 significant bits, which
    float32 has, so every value is exact, the largest 1 - 2^-24 and the smallest 2^-24. (24 bits
    would not do: (2^24 - 1) + 0.5 needs 25 and rounds to 2^24, a draw of exactly 1.0, whose
    Gumbel noise is +inf: a filtered token's -inf plus +inf is NaN, and argmax picks the NaN.)
    """
    # h: [...] int32; `(h >> 9) & mask` is the logical shift of the unsigned bits
    return (((h >> 9) & 0x7FFFFF).float() + 0.5) / float(1 << 23)


def top_k_filter(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Set every logit below the row's k-th largest to -inf."""
    # logits: [B, V]; top_k: [B] in 1..V
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (top_k - 1)[:, None])  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability reaches p; the rest go to -inf."""
    # logits: [B, V]; top_p: [B] in (0, 1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    # the top token has 0 before it: always kept; a row with p = 1 keeps everything (its
    # float cumsum may round past 1, and a row must not depend on its batch-mates' p)
    drop_sorted = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, batch: SamplingBatch, allowed: torch.Tensor | None = None,
           all_greedy: bool | None = None) -> torch.Tensor:
    """One token per row: [B] long, on the logits' device."""
    # logits: [B, V]; allowed: [B, V] bool (constrained decoding) or None
    logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    greedy_tokens = logits.argmax(dim=-1)  # [B]
    if all_greedy if all_greedy is not None else batch.all_greedy:
        return greedy_tokens
    temp = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    scaled = logits / temp[:, None]
    if batch.any_top_k:  # each filter sorts every row: skipped when no row cuts
        scaled = top_k_filter(scaled, batch.top_k)
    if batch.any_top_p:
        scaled = top_p_filter(scaled, batch.top_p)
    gumbel = -torch.log(-torch.log(uniform_noise(batch.seed, batch.counter, logits.shape[1])))
    # Gumbel-max: a draw from softmax(scaled). The noise is finite (hash_to_unit), so a token
    # that a filter or a mask removed stays at -inf + noise = -inf: it is never drawn
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(batch.temperature > 0, sampled, greedy_tokens)
