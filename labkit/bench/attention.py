"""`python -m labkit bench attention`: naive, flash (PyTorch tiles) and torch SDPA, side by side.

For each phase (prefill: Tq = S queries over S keys, causal; decode: 1 query over S keys) and
each context length S, the three implementations run in alternating turns on the same q, k, v
(median of `--repeats` turns each), then once more under the allocator's watch for the peak
memory. Each row: `{phase, seq_len, impl, ms, ms_spread, peak_bytes, allocated_bytes,
predicted_bytes_moved, max_abs_err}`.

- `peak_bytes`: the largest total of tensor allocations made during one call, above what was
  allocated before it, read from torch.profiler's allocation events (a real measurement; the
  inputs are not counted, the output is). `allocated_bytes`: the sum of those allocations, the
  bytes of every new tensor the call wrote (measured the same way).
- `predicted_bytes_moved`: the algorithm's memory traffic counted line by line below, in the
  style of the Triton tutorials (fp32: 4 bytes an element). Flash counts a tile's scores as
  staying on chip, which is the GPU kernel's property; on a CPU they stay in cache only while a
  tile fits it. A CPU gives no portable reading of traffic; what the allocator can check is the
  new-tensor part of the count (`naive_lines`' last column against `allocated_bytes`).
- `max_abs_err`: against naive attention, in fp32.

Then a tile-size sweep of flash prefill at one S: its Python tile loop costs a few
microseconds per tile, so small tiles are slow and large tiles cost memory.

`--impls` also takes the engine's attention backends, reading the same K and V from a paged
pool (pages of `POOL_BLOCK` tokens, scattered) through a block table, each call writing the
step's new k and v first, as in a forward: `paged-cpp` (PagedAttention's C++ kernel),
`flash-cpp` (FlashAttention's C++ kernel: tiles of `POOL_TILE` keys, split-K for decode) and
`flash-py` (FlashAttention.reference, the same tiles in PyTorch). Their predicted bytes count
each (token, KV head) reading its own keys once, as their loops do (block_q = 1).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch
from torch.nn import functional as F

from labkit.attention import (
    FlashAttention,
    FlashMeta,
    PagedAttention,
    flash_attention,
    flash_decode,
    naive_attention,
)
from labkit.cli_parser import command_parser
from labkit.model import ModelConfig
from labkit.paged_kv import PagedKVCache

SEQ_LENS = (512, 1024, 2048, 4096, 8192)
QUICK_SEQ_LENS = (512, 1024, 2048)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64  # grouped-query, two query heads per KV head
BLOCK_Q, BLOCK_K = 256, 256  # flash prefill's tiles (see the sweep)
DECODE_SPLITS, DECODE_BLOCK_K = 4, 2048  # flash-decoding: chunks, and the tile inside each
POOL_BLOCK, POOL_TILE = 16, 256  # the engine backends' pool: tokens a page, keys a flash tile
BACKEND_IMPLS = ("paged-cpp", "flash-cpp", "flash-py")  # on request (--impls)
F32 = 4  # bytes per element


@contextlib.contextmanager
def _quiet_stderr_fd() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null: kineto, torch's profiler library, writes
    `USDT: ... profiler_start` and `profiler_stop` there from C++ (no setting turns it off)."""
    sys.stderr.flush()
    try:
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:  # no descriptor 2 to silence
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def memory_use(fn: Callable[[], object]) -> tuple[int, int]:
    """(peak, allocated) bytes of the tensors `fn()` allocates, read from torch's allocator.

    Every CPU tensor's allocation and free passes the profiler (`profile_memory=True`) with the
    allocator's running total. peak: the largest total during the call, above the total just
    before it (the inputs are not counted, the output is); allocated: the sum of every
    allocation's size, i.e. the bytes of all the new tensors the call wrote.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr_fd():  # only around start and stop: fn's own stderr is left alone
        prof.start()
    try:
        fn()
    finally:
        with _quiet_stderr_fd():
            prof.stop()
    events = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            events.append((node.start_time_ns, f.alloc_size, f.total_allocated))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    if not events:
        return 0, 0
    events.sort()
    before = events[0][2] - events[0][1]  # the allocator's total just before the first event
    return (max(total for _, _, total in events) - before,
            sum(size for _, size, _ in events if size > 0))


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of tensors allocated while `fn()` runs, above the total before it."""
    return memory_use(fn)[0]


# -- predicted bytes, counted line by line (B = 1) --------------------------------------------

def naive_lines(tq: int, seq_len: int, h: int = HEADS, hkv: int = KV_HEADS, d: int = HEAD_DIM,
                causal: bool = True) -> list[tuple[str, int, int, int]]:
    """`labkit.attention.naive_attention`, one line at a time (B = 1): (line, bytes read, bytes
    written, bytes of the new tensors it makes). A line counts one pass over what it reads and
    writes (a kernel may make more passes than that); the new tensors are exact, and the
    allocator can check them (`memory_use`)."""
    sq = h * tq * seq_len  # one [H, Tq, L] score matrix, in elements
    rows = [  # (line, elements read, elements written, elements of new tensors)
        ("repeat_interleave k, v", 2 * hkv * seq_len * d, 2 * h * seq_len * d,
         2 * h * seq_len * d),
        ("q / sqrt(D)", h * tq * d, h * tq * d, h * tq * d),
        ("scores = q @ k^T", h * tq * d + h * seq_len * d, sq, sq),
    ]
    if causal:  # the bool mask is Tq * L bytes: a quarter of an fp32 element each
        rows += [("hidden = positions > i", 0, tq * seq_len / F32, tq * seq_len / F32),
                 ("masked_fill", sq + tq * seq_len / F32, sq, sq)]
    rows += [
        # torch's logsumexp: amax, then exp(scores - max) as its own [H, Tq, L] temporary,
        # exponentiated in place, summed; a pass per step
        ("logsumexp", 4 * sq, 2 * sq + h * tq, sq + h * tq),
        ("softmax", sq, sq, sq),
        ("probs @ v", sq + h * seq_len * d, h * tq * d, h * tq * d),
    ]
    return [(what, int(r * F32), int(w * F32), int(n * F32)) for what, r, w, n in rows]


def naive_bytes(tq: int, seq_len: int, h: int = HEADS, hkv: int = KV_HEADS,
                d: int = HEAD_DIM, causal: bool = True) -> int:
    """Traffic of `labkit.attention.naive_attention`: every byte its lines read and write."""
    return sum(r + w for _, r, w, _ in naive_lines(tq, seq_len, h, hkv, d, causal))


def flash_bytes(tq: int, seq_len: int, h: int = HEADS, hkv: int = KV_HEADS, d: int = HEAD_DIM,
                causal: bool = True, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> int:
    """Traffic of `labkit.attention.flash_attention`: its loops, walked without the math."""
    n = 0
    for i0 in range(0, tq, block_q):
        i1 = min(i0 + block_q, tq)
        n += h * (i1 - i0) * d  # read the Q block once
        end = min(seq_len, seq_len - tq + i1) if causal else seq_len
        n += 2 * hkv * end * d  # read K and V tiles up to the causal limit (once per KV head)
        n += h * (i1 - i0) * (d + 1)  # write the O block and its lse; scores stay in the tile
    return n * F32


def flash_tile_bytes(tq: int, seq_len: int, h: int = HEADS, d: int = HEAD_DIM,
                     causal: bool = True, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> int:
    """Bytes of every score tile `flash_attention`'s loops compute, [G * bq, bk] per KV head:
    what flash_bytes leaves out because a GPU kernel keeps them on chip. On a CPU each tile is
    a tensor the allocator hands out (and, when small, the cache keeps)."""
    n = 0
    for i0 in range(0, tq, block_q):
        i1 = min(i0 + block_q, tq)
        end = min(seq_len, seq_len - tq + i1) if causal else seq_len
        n += h * (i1 - i0) * end  # the tiles of this query block cover keys 0 .. end
    return n * F32


def flash_decode_bytes(seq_len: int, h: int = HEADS, hkv: int = KV_HEADS, d: int = HEAD_DIM,
                       splits: int = DECODE_SPLITS) -> int:
    """Traffic of `labkit.attention.flash_decode` for one query per head."""
    chunks = -(-seq_len // -(-seq_len // splits))
    n = 2 * hkv * seq_len * d  # every chunk reads its K and V once: all of them, once
    n += chunks * h * d  # each chunk reads q
    n += chunks * h * (d + 1)  # each chunk writes its partial out and lse
    n += (chunks - 1) * 3 * h * (d + 1)  # each merge reads two partials, writes one
    return n * F32


def sdpa_bytes(tq: int, seq_len: int, h: int = HEADS, hkv: int = KV_HEADS,
               d: int = HEAD_DIM) -> int:
    """The fused ideal: read Q, K, V once, write O once (what a perfect kernel would move)."""
    return (h * tq * d + 2 * hkv * seq_len * d + h * tq * d) * F32


# -- the three implementations, one signature --------------------------------------------------

def _sdpa(q, k, v, causal):
    # SDPA's is_causal aligns top-left; the two phases here are Tq = L (same as ours) or Tq = 1
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal and q.shape[2] > 1,
                                          enable_gqa=True), None


def implementations(phase: str, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> dict:
    """impl name -> fn(q, k, v) -> (out, lse or None) for a phase."""
    causal = phase == "prefill"
    if phase == "decode":
        flash = lambda q, k, v: flash_decode(q, k, v, num_splits=DECODE_SPLITS,  # noqa: E731
                                             block_k=DECODE_BLOCK_K)
    else:
        flash = lambda q, k, v: flash_attention(q, k, v, causal=True,  # noqa: E731
                                                block_q=block_q, block_k=block_k)
    return {"naive": lambda q, k, v: naive_attention(q, k, v, causal=causal),
            "flash": flash, "sdpa": lambda q, k, v: _sdpa(q, k, v, causal)}


class _PoolBackend:
    """fn(q, k, v) -> (out, None) for one of the engine's backends: the context k, v laid in a
    scattered paged pool once per input (made on the first call with it), then each call
    attends the last Tq tokens as one sequence's step: writes their k and v, then attends."""

    def __init__(self, impl: str):
        self.impl = impl
        self._for: tuple | None = None  # (q, the backend, q, k, v of the step)

    def _setup(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        _, h, tq, d = q.shape
        hkv, seq_len = k.shape[1], k.shape[2]
        cfg = ModelConfig.tiny().with_(num_heads=h, num_kv_heads=hkv, head_dim=d, num_layers=1)
        pages = -(-seq_len // POOL_BLOCK)
        table = torch.randperm(pages, generator=torch.Generator().manual_seed(0))  # scattered
        store = PagedKVCache(cfg, pages, POOL_BLOCK)
        slots = table[torch.arange(seq_len) // POOL_BLOCK] * POOL_BLOCK + torch.arange(
            seq_len) % POOL_BLOCK  # [S]
        store.write(0, slots, k[0].transpose(0, 1), v[0].transpose(0, 1))  # [S, Hkv, D]
        if self.impl == "paged-cpp":
            attn, meta_type = PagedAttention(store), PagedAttention.meta_type
        else:
            attn = FlashAttention(store, POOL_TILE, cpu_kernel=self.impl == "flash-cpp")
            meta_type = FlashMeta
        attn.begin_step(meta_type.build(torch.tensor([tq]), torch.tensor([seq_len - tq]),
                                        table[None], POOL_BLOCK))
        step = (q[0].transpose(0, 1).contiguous(),  # [Tq, H, D]: the step's packed queries
                k[0, :, seq_len - tq:].transpose(0, 1), v[0, :, seq_len - tq:].transpose(0, 1))
        self._for = (q, attn, step)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if self._for is None or self._for[0] is not q:
            self._setup(q, k, v)
        _, attn, (qs, ks, vs) = self._for
        out = attn.attend(0, qs, ks, vs)  # [Tq, H, D]
        return out.transpose(0, 1)[None], None  # [1, H, Tq, D]


def backend_implementations() -> dict:
    """impl name -> fn(q, k, v) -> (out, None) for the engine's backends over a paged pool."""
    return {name: _PoolBackend(name) for name in BACKEND_IMPLS}


def predicted(phase: str, impl: str, seq_len: int, block_q: int = BLOCK_Q,
              block_k: int = BLOCK_K) -> int:
    """predicted_bytes_moved of one row."""
    tq = seq_len if phase == "prefill" else 1
    if impl == "naive":
        return naive_bytes(tq, seq_len, causal=phase == "prefill")
    if impl == "sdpa":
        return sdpa_bytes(tq, seq_len)
    if impl in BACKEND_IMPLS:  # each (token, KV head) reads its keys: query blocks of one
        return flash_bytes(tq, seq_len, block_q=1)
    if phase == "decode":
        return flash_decode_bytes(seq_len)
    return flash_bytes(tq, seq_len, block_q=block_q, block_k=block_k)


def inputs(phase: str, seq_len: int, seed: int = 0):
    """Seeded q [1, H, Tq, D], k, v [1, Hkv, S, D] in fp32."""
    gen = torch.Generator().manual_seed(seed)
    tq = seq_len if phase == "prefill" else 1
    q = torch.randn(1, HEADS, tq, HEAD_DIM, generator=gen)
    k = torch.randn(1, KV_HEADS, seq_len, HEAD_DIM, generator=gen)
    v = torch.randn(1, KV_HEADS, seq_len, HEAD_DIM, generator=gen)
    return q, k, v


def _time_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def ratio_sampler(top: Callable[[], object], bottom: Callable[[], object]
                  ) -> Callable[[], float]:
    """A sampler for `labkit.claims.measure`: each call times `top()` and `bottom()` back to
    back, in the other order than the call before (another program's load falls on both
    alike), and returns top's time over bottom's. Both are called once first, to warm up."""
    top()
    bottom()
    turn = itertools.count()

    def sample() -> float:
        first_top = next(turn) % 2 == 0
        t_top = t_bottom = 0.0
        for is_top in ((True, False) if first_top else (False, True)):
            t0 = time.perf_counter()
            (top if is_top else bottom)()
            if is_top:
                t_top = time.perf_counter() - t0
            else:
                t_bottom = time.perf_counter() - t0
        return t_top / t_bottom
    return sample


def bench_rows(phase: str, seq_len: int, repeats: int, impls: dict) -> list[dict]:
    """The rows of one (phase, S): alternating turns, medians; peak; error against naive."""
    q, k, v = inputs(phase, seq_len)
    ref = impls["naive"](q, k, v)[0] if "naive" in impls else None
    names = list(impls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names:  # warm-up turn: first calls pay for allocation and dispatch
        impls[n](q, k, v)
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):  # alternate who goes first
            times[n].append(_time_ms(lambda n=n: impls[n](q, k, v)))
    rows = []
    for n in names:
        out = impls[n](q, k, v)[0]
        peak, allocated = memory_use(lambda n=n: impls[n](q, k, v))
        rows.append({
            "phase": phase, "seq_len": seq_len, "impl": n,
            "ms": statistics.median(times[n]),
            "ms_spread": [min(times[n]), max(times[n])],
            "peak_bytes": peak, "allocated_bytes": allocated,
            "predicted_bytes_moved": predicted(phase, n, seq_len),
            "max_abs_err": None if ref is None else float((out - ref).abs().max()),
        })
    return rows


def tile_sweep(seq_len: int, blocks: tuple[int, ...], repeats: int) -> list[dict]:
    """Flash prefill at one S for square tiles of each size: ms (alternating turns) and peak."""
    q, k, v = inputs("prefill", seq_len)
    fns = {bk: (lambda bk=bk: flash_attention(q, k, v, block_q=bk, block_k=bk)) for bk in blocks}
    for fn in fns.values():
        fn()
    times: dict[int, list[float]] = {bk: [] for bk in blocks}
    for r in range(repeats):
        for bk in (blocks if r % 2 == 0 else blocks[::-1]):
            times[bk].append(_time_ms(fns[bk]))
    rows = []
    for bk in blocks:
        peak, allocated = memory_use(fns[bk])
        rows.append({"sweep": "tile", "phase": "prefill", "seq_len": seq_len, "impl": "flash",
                     "block_q": bk, "block_k": bk, "ms": statistics.median(times[bk]),
                     "ms_spread": [min(times[bk]), max(times[bk])],
                     "peak_bytes": peak, "allocated_bytes": allocated,
                     "predicted_bytes_moved": flash_bytes(seq_len, seq_len, block_q=bk,
                                                          block_k=bk)})
    return rows


def _ints(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals or any(x < 1 for x in vals):
        raise ValueError
    return vals


def main(argv: list[str]) -> int:
    """Entry point of `python -m labkit bench attention`."""
    p = command_parser("python -m labkit bench attention",
                       "naive vs flash (PyTorch tiles) vs torch SDPA, and the engine's "
                       "backends: time, peak memory, predicted bytes, error")
    p.add_argument("--seq-lens", default=None,
                   help=f"comma-separated S (none given: {','.join(map(str, SEQ_LENS))}; "
                        f"--quick {','.join(map(str, QUICK_SEQ_LENS))})")
    p.add_argument("--quick", action="store_true",
                   help=f"S = {','.join(map(str, QUICK_SEQ_LENS))}, 3 turns, a small sweep")
    p.add_argument("--phases", default="prefill,decode", help="prefill, decode or both")
    p.add_argument("--impls", default="naive,flash,sdpa",
                   help="which implementations: naive, flash, sdpa, and the engine's backends "
                        f"over a paged pool: {', '.join(BACKEND_IMPLS)}")
    p.add_argument("--repeats", type=int, default=5, help="timed turns per implementation")
    p.add_argument("--sweep-seq-len", type=int, default=None,
                   help="S of the tile-size sweep (none given: 4096, --quick 1024); 0: no sweep")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: with 2 threads on 2 shared cores, flash's "
                        "many small tile ops stall in the thread pool whenever another program "
                        "holds a core; measured at S=2048 under load: 307 ms at 1 thread, "
                        "1985 ms at 2)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    args = p.parse_args(argv)
    try:
        seq_lens = _ints(args.seq_lens) if args.seq_lens else list(
            QUICK_SEQ_LENS if args.quick else SEQ_LENS)
    except ValueError:
        print(f"error: --seq-lens must be positive integers like 512,1024 (got "
              f"{args.seq_lens!r})", file=sys.stderr)
        return 2
    phases = [x for x in args.phases.split(",") if x]
    names = [x for x in args.impls.split(",") if x]
    if set(phases) - {"prefill", "decode"} \
            or set(names) - {"naive", "flash", "sdpa", *BACKEND_IMPLS} or args.repeats < 1:
        print("error: --phases takes prefill,decode; --impls naive,flash,sdpa,"
              f"{','.join(BACKEND_IMPLS)}; --repeats >= 1", file=sys.stderr)
        return 2
    if args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick and args.repeats == 5 else args.repeats
    sweep_s = args.sweep_seq_len if args.sweep_seq_len is not None else (
        1024 if args.quick else 4096)
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    log(f"bench attention: H={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}, fp32, B=1, "
        f"{torch.get_num_threads()} torch threads; median of {repeats} alternating turns")
    rows = []
    for phase in phases:
        for s in seq_lens:
            every = {**implementations(phase), **backend_implementations()}
            impls = {n: every[n] for n in names}
            for r in bench_rows(phase, s, repeats, impls):
                rows.append(r)
                if args.json:
                    print(json.dumps(r), flush=True)
                else:
                    err = "-" if r["max_abs_err"] is None else f"{r['max_abs_err']:.1e}"
                    log(f"{r['phase']:<8} S={s:>5} {r['impl']:<9} {r['ms']:>9.2f} ms  "
                        f"peak {r['peak_bytes'] / 2**20:>9.2f} MiB  allocated "
                        f"{r['allocated_bytes'] / 2**20:>9.2f} MiB  predicted "
                        f"{r['predicted_bytes_moved'] / 2**20:>9.2f} MiB moved  err {err}")
    if sweep_s:
        blocks = (64, 128, 256, 512, 1024) if not args.quick else (64, 256, 1024)
        for r in tile_sweep(sweep_s, blocks, repeats):
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                log(f"sweep    S={sweep_s:>5} tile {r['block_q']:>4}x{r['block_k']:<4} "
                    f"{r['ms']:>9.2f} ms  peak {r['peak_bytes'] / 2**20:>9.2f} MiB")
    return 0
