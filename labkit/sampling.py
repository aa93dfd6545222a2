"""Choosing the next token, on the device, reproducibly.

`SamplingParams` says how a request wants its tokens chosen. `sample()` turns a batch of logits
into one token per row without leaving the device: rows with penalties first have their logits
lowered for the tokens they already used (`Penalties`); greedy rows take the argmax; sampled rows
are scaled by their temperature, cut by top-k and top-p, and drawn with the Gumbel-max trick,
`argmax(logits + Gumbel noise)`, which samples exactly from softmax(logits). `token_logprobs()`
gives the log-probabilities a request asked for, from the model's own logits.

The noise is not drawn from a global generator. It is a hash of (request seed, token index,
vocabulary id), so a request's tokens depend only on its own seed and its own history: the same
request gives the same tokens alone or in any batch, in the blocking or the pipelined decoder,
and on any device. (A shared `torch.Generator` would hand each request whatever numbers were left
after the rows before it.)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from labkit.kernels import cpu as cpu_kernels

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).smallest_subnormal)
# below this a temperature is refused: logits of magnitude up to ~1e32 divided by it still fit
# in float32 (the largest is 3.4e38); 1e-6 is already greedy in all but exact ties
MIN_TEMPERATURE = 1e-6
MAX_LOGPROBS = 20  # alternatives a request may ask for per token (the OpenAI API's limit)
MAX_SAMPLES = 128  # parallel samples of one prompt (OpenAI allows 128 choices)
# speculative decoding (labkit.speculative): who drafts, and at most how many tokens a step
PROPOSERS = ("int4", "int8", "ngram")  # a quantized copy of the model, or prompt lookup
MAX_DRAFT = 16


def _mix64(x: int) -> int:
    """A 64-bit integer hash (splitmix64's finalizer): distinct seeds per sample."""
    x &= 2**64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return x ^ (x >> 31)


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
    # OpenAI's penalties, on the tokens generated so far: minus presence once a token has
    # appeared, minus frequency times its count (both in [-2, 2]; 0: none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # the CTRL / Hugging Face penalty on every token of prompt and answer: a positive logit is
    # divided by it, a negative one multiplied (1: none; > 1 discourages repeats)
    repetition_penalty: float = 1.0
    # None: no log-probabilities; k: each token's, and the k most likely in its place
    logprobs: int | None = None
    n: int = 1  # parallel sampling: answers to draw for the prompt (see `sample`)
    # speculative decoding: "<proposer>:<k>", k tokens drafted per step by a proposer of
    # PROPOSERS ("int4:4", "ngram:3"), verified by the model in one launch; None: off
    speculative: str | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2] (0: none), got {v!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not 0 < r <= 100:  # NaN fails too; above 100 is no penalty
            raise ValueError(f"repetition_penalty must be a number in (0, 100] (1: none; "
                             f"above 1 discourages repeats), got {r!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}] "
                             f"(the alternatives to return per token), got {self.logprobs!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n must be an integer in [1, {MAX_SAMPLES}] (answers per prompt), "
                             f"got {self.n!r}")
        if self.speculative is not None:
            parse_speculative(self.speculative)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        ints = ("max_new_tokens", "seed", "n") + (("top_k",) if self.top_k is not None else ()) + (
            ("logprobs",) if self.logprobs is not None else ())
        for name in ints:
            object.__setattr__(self, name, int(getattr(self, name)))  # numpy ints -> int

    @property
    def greedy(self) -> bool:
        """True when the argmax is taken (temperature 0)."""
        return self.temperature == 0

    def sample(self, j: int) -> SamplingParams:
        """The settings of sample j of n (n = 1 each): sample 0 keeps the seed, sample j > 0
        draws with a seed hashed from (seed, j), so the n answers differ and each is what a
        single request with that seed would get. Greedy samples are all the same answer."""
        if not 0 <= j < self.n:
            raise ValueError(f"sample {j} of n={self.n}")
        seed = self.seed if j == 0 else int(
            _mix64(self.seed ^ (j * 0x9E3779B97F4A7C15 & (2**64 - 1)))) % 2**63
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def draft(self) -> tuple[str, int] | None:
        """Speculative decoding's (proposer, k), or None when it is off."""
        return None if self.speculative is None else parse_speculative(self.speculative)

    @property
    def penalized(self) -> bool:
        """True when the tokens already used change the logits."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def parse_speculative(spec: str) -> tuple[str, int]:
    """"int4:4" -> ("int4", 4): the proposer and the tokens it drafts per step."""
    proposer, _, k = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if proposer not in PROPOSERS or not k.isdigit() or not 1 <= int(k) <= MAX_DRAFT:
        raise ValueError(f"speculative must be '<proposer>:<k>' with a proposer of {PROPOSERS} "
                         f"and k in 1..{MAX_DRAFT} drafted tokens per step (e.g. 'int4:4', "
                         f"'ngram:3'), got {spec!r}")
    return proposer, int(k)


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


History = dict[int, tuple[list[int], list[int]]]  # batch row -> (prompt ids, output ids)
# speculative decoding, a verify step's sampled rows: row -> (draft tokens, their q [k, V])
Drafts = dict[int, tuple[list[int], torch.Tensor]]


def draft_seed(seed: int) -> int:
    """The seed of a request's draft stream (labkit.speculative): independent of the target's
    draws and of the acceptance draws, and keyed by (seed, token index) like them."""
    return (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**63


def accept_seed(seed: int) -> int:
    """The seed of a request's acceptance draws (the u of u < p/q)."""
    return (seed * 0xD1B54A32D192ED03 + 0x8CB92BA72F3D8DD7) % 2**63


@dataclass
class Penalties:
    """The penalized rows of one step, as device tensors: which tokens each has used.

    Built from the host's history at sample time: in the pipelined loop the host has just
    committed the previous token, so the history is complete (like a constraint's mask).
    """

    rows: torch.Tensor  # [P] long: batch rows with a penalty
    counts: torch.Tensor  # [P, V] float: times each token appears in the row's output
    seen: torch.Tensor  # [P, V] bool: the token appears in its prompt or its output
    presence: torch.Tensor  # [P, 1] float
    frequency: torch.Tensor  # [P, 1] float
    repetition: torch.Tensor  # [P, 1] float

    @staticmethod
    def build(history: History | None, params: list[SamplingParams], vocab_size: int,
              device: torch.device, to_device=torch.tensor) -> Penalties | None:
        """From `history` (rows with a penalty; others are ignored); None if no row has one.
        `to_device`: list -> tensor on `device` (the runner's, which stages through pinned
        memory on a GPU so that the host does not wait)."""
        rows = sorted(r for r in (history or {}) if params[r].penalized)
        if not rows:
            return None
        # three flat uploads of (row, token) pairs and the settings, scattered on the device
        out_rows, out_ids, seen_rows, seen_ids = [], [], [], []
        for i, r in enumerate(rows):
            prompt, output = history[r]
            out_rows += [i] * len(output)
            out_ids += output
            seen_rows += [i] * (len(prompt) + len(output))
            seen_ids += list(prompt) + list(output)
        counts = torch.zeros(len(rows), vocab_size, device=device)
        if out_ids:
            counts.index_put_((to_device(out_rows), to_device(out_ids)),
                              torch.ones(len(out_ids), device=device), accumulate=True)
        seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
        seen[to_device(seen_rows), to_device(seen_ids)] = True
        settings = to_device([[float(params[r].presence_penalty),
                               float(params[r].frequency_penalty),
                               float(params[r].repetition_penalty)] for r in rows])
        return Penalties(to_device(rows), counts, seen, settings[:, 0:1], settings[:, 1:2],
                         settings[:, 2:3])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with each penalized row's penalties applied (a new tensor): repetition
        first, then frequency and presence, as vLLM orders them."""
        # logits: [B, V] float
        part = logits[self.rows]  # [P, V]
        rep = self.repetition
        part = torch.where(self.seen, torch.where(part > 0, part / rep, part * rep), part)
        part = part - self.frequency * self.counts - self.presence * (self.counts > 0)
        return logits.index_copy(0, self.rows, part)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """[B, 1 + 2k] float: each row's log-probability of its token, then its k most likely
    tokens' log-probabilities and their ids (exact in float32 below 2^24), in one tensor so
    that one copy brings them to the host.

    From the model's own distribution, log_softmax of the logits before penalties,
    temperature, filters and masks (what vLLM returns by default): how likely the model found
    the token, not how the request's settings reshaped the draw.
    """
    # logits: [B, V]; tokens: [B] long
    assert logits.shape[-1] < 1 << 24, "token ids must be exact in float32"
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None])  # [B, 1]
    top = logp.topk(k, dim=-1)  # sorted, most likely first
    return torch.cat([chosen, top.values, top.indices.float()], dim=1)


def unpack_logprobs(row: list[float], k: int) -> tuple[float, list[tuple[int, float]]]:
    """One row of `token_logprobs` on the host, cut to the request's own k: (the token's
    log-probability, [(id, log-probability)] of the k most likely)."""
    width = (len(row) - 1) // 2
    return row[0], [(int(row[1 + width + j]), row[1 + j]) for j in range(k)]


def sample(logits: torch.Tensor, batch: SamplingBatch | None, allowed: torch.Tensor | None = None,
           all_greedy: bool | None = None, penalties: Penalties | None = None) -> torch.Tensor:
    """One token per row: [B] long, on the logits' device. `batch` may be None where
    `all_greedy` is True (the argmax reads no setting)."""
    # logits: [B, V]; allowed: [B, V] bool (constrained decoding) or None
    logits = logits.float()
    if penalties is not None:  # before the mask: a masked token stays at -inf either way
        logits = penalties.apply(logits)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    greedy_tokens = argmax_rows(logits)  # [B]
    if all_greedy if all_greedy is not None else batch.all_greedy:
        return greedy_tokens
    if batch is None:
        raise ValueError("sample: a batch of settings is needed where a row samples")
    # Gumbel-max: a draw from softmax(scaled). The noise is finite (hash_to_unit), so a token
    # that a filter or a mask removed stays at -inf + noise = -inf: it is never drawn
    sampled = argmax_rows(shaped_logits(logits, batch) + gumbel_noise(batch, logits.shape[1]))
    return torch.where(batch.temperature > 0, sampled, greedy_tokens)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for x [B, V]: the first index of each row's largest value (a NaN the
    largest). On a CPU, labkit's kernel where it serves: torch's CPU argmax reads a SmolLM2 row
    (49,152 logits) at ~5 GB/s, ~40-65 us of a greedy decode step at batch 1."""
    kernels = cpu_kernels.usable(x)
    if kernels is not None and x.dim() == 2 and x.shape[1] > 0 and x.is_contiguous():
        return kernels.argmax_rows(x)
    return x.argmax(dim=-1)


def shaped_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Logits divided by each row's temperature, cut by its top-k and top-p: [B, V] float.
    Their softmax is the distribution a sampled row draws from."""
    # logits: [B, V] float (penalties and masks already applied)
    temp = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    scaled = logits / temp[:, None]
    if batch.any_top_k:  # each filter sorts every row: skipped when no row cuts
        scaled = top_k_filter(scaled, batch.top_k)
    if batch.any_top_p:
        scaled = top_p_filter(scaled, batch.top_p)
    return scaled


def gumbel_noise(batch: SamplingBatch, vocab_size: int) -> torch.Tensor:
    """Gumbel noise [B, V] keyed by each row's (seed, counter): finite everywhere."""
    return -torch.log(-torch.log(uniform_noise(batch.seed, batch.counter, vocab_size)))


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u: torch.Tensor,
                     gumbel: torch.Tensor) -> torch.Tensor:
    """Speculative sampling's rule: the target's choice at each of the k + 1 positions, [k + 1].

    Draft token d_j (drawn from q_j) is accepted with probability min(1, p_j(d)/q_j(d)); where
    it is rejected the choice is drawn from the residual max(0, p_j - q_j), normalised, and
    position k (the bonus) draws from p_k. The accepted prefix plus the next choice is then
    distributed exactly as k + 1 draws from the target (Leviathan et al. 2023, Chen et al.
    2023). A rejected position never chooses its draft (the residual is 0 there), so the
    caller recovers the accepted run as the longest prefix where choice == draft.
    """
    # p: [k+1, V] target probabilities; q: [k, V] draft probabilities; draft: [k] long;
    # u: [k] uniform in (0, 1); gumbel: [k+1, V] finite Gumbel noise
    k = draft.shape[0]
    p_d = p[:k].gather(1, draft[:, None])[:, 0]  # [k]
    q_d = q.gather(1, draft[:, None])[:, 0]  # [k]
    accept = u * q_d < p_d  # u < p/q: probability min(1, p/q), no division by a zero q
    residual = (p[:k] - q).clamp(min=0)  # [k, V]
    # a row with no residual mass (p == q in float) never rejects; p keeps its draw defined
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:k])
    resampled = (residual.log() + gumbel[:k]).argmax(-1)  # [k]: a draw from the residual
    bonus = (p[k].log() + gumbel[k]).argmax(-1, keepdim=True)  # [1]: a draw from p_k
    return torch.cat([torch.where(accept, draft, resampled), bonus])
