"""A model's weights in 2 MiB pages, in the order a step reads them.

At batch 1 a decode step reads every weight once, so the step is as fast as the memory streams
them. How fast it streams depends on the pages they sit in, not only on the DRAM. Linux maps
memory in 4 KiB pages unless asked (`/sys/kernel/mm/transparent_hugepage/enabled` reads
`[madvise]` on most distributions): a 538 MB fp32 SmolLM2 is then 131,000 pages, each a TLB
entry to find (under a hypervisor, a walk through two page tables), and the CPU's prefetchers
stop at every page's end, since the next 4 KiB page may lie anywhere. Weights memory-mapped
from the cache (labkit.loading) are such pages, and so is any tensor torch allocates.

`place_weights` copies a model's parameters and buffers into one buffer, each after the one
before it in the model's order (a layer's projections, then the next layer's), and asks the
kernel for 2 MiB pages there (madvise MADV_HUGEPAGE, before the pages are first touched).
Measured on this course's 2-core VM (results/cpu-kernels-2026-12-05c.md): the read probe over
540 MB 1.09-1.38x faster in 2 MiB pages than in 4 KiB pages with 2 threads (1.6x with one), a
bare decode step at batch 1 1.05-1.13x faster; the outputs are the same bits (the same values,
the same kernels).

`LABKIT_HUGE_PAGES=0` keeps the pages the weights were loaded in. Elsewhere than Linux, or
where the kernel's setting is `[never]`, `place_weights` does nothing and says why
(`huge_pages()`). Benchmarks read their probe buffers from the same kind of pages (`empty`),
so a kernel is held against the fastest read this CPU makes.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
import sys
from pathlib import Path

import torch

from labkit.utils.memory import LIBC

HUGE = 2 << 20  # bytes in one huge page on x86-64 and most ARM64 kernels
MIN_BYTES = 32 << 20  # smaller models are left as they are (they fit the last-level cache)
ALIGN = 64  # each tensor starts on a cache line
LARGE = 16 << 20  # a tensor this large gets a buffer of its own (a shared embedding)
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
_MADV_DONTNEED = 4
_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages() -> str | None:
    """None where `empty` can ask for 2 MiB pages; else why not (a sentence)."""
    if os.environ.get("LABKIT_HUGE_PAGES", "1") == "0":
        return "LABKIT_HUGE_PAGES=0"
    if not hasattr(LIBC, "madvise"):
        return f"no madvise on {sys.platform}"
    try:
        setting = _SETTING.read_text().strip()
    except OSError:
        return f"{_SETTING} is not readable (no transparent huge pages in this kernel)"
    if "[never]" in setting:
        return f"the kernel's transparent huge pages are off ({_SETTING}: {setting})"
    return None


def empty(nbytes: int, huge: bool = True) -> torch.Tensor:
    """An uninitialised uint8 tensor of `nbytes` bytes on 2 MiB pages where `huge_pages()`
    allows (its start 2 MiB-aligned; the kernel gives huge pages as it is first written, and 4
    KiB ones where it has none free); else a plain torch allocation. `huge=False`: on 4 KiB
    pages for certain, where a plain allocation might get 2 MiB ones (the kernel's setting
    `[always]`, or heap memory an earlier `empty` asked them for)."""
    if not huge:
        # no huge pages from now on (MADV_NOHUGEPAGE), and none kept from before: heap memory
        # can still sit in a huge page an earlier tenant got, which that advice alone leaves;
        # MADV_DONTNEED drops the span's pages (its bytes are no one's yet), so they fault in
        # afresh, 4 KiB at a time
        return _advised(nbytes, 4096, (_MADV_NOHUGEPAGE, _MADV_DONTNEED))
    if huge_pages() is not None or nbytes < HUGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    # torch's allocator, over-allocated by a page: glibc maps a block of 32 MiB or more afresh
    # (its mmap threshold is at most that), so no page of it has been touched yet; a smaller
    # one may come from its heap, whose pages touched before stay 4 KiB (`huge_bytes` tells)
    return _advised(nbytes, HUGE, (_MADV_HUGEPAGE,))


def _advised(nbytes: int, align: int, advice: tuple[int, ...]) -> torch.Tensor:
    """`nbytes` from a torch allocation over-allocated by `align`, starting `align`-aligned,
    its whole pages given each madvise `advice` in turn; a plain allocation where one fails
    (EINVAL on a kernel built without THP) or there is no madvise."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    start = (-raw.data_ptr()) % align
    span = (raw.numel() - start) // 4096 * 4096  # whole pages, all of them inside `raw`
    at = ctypes.c_void_p(raw.data_ptr() + start)
    if not hasattr(LIBC, "madvise") or any(LIBC.madvise(at, ctypes.c_size_t(span), a) != 0
                                           for a in advice):
        return torch.empty(nbytes, dtype=torch.uint8)
    return raw[start:start + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros, on 2 MiB pages where `empty` gives them (a KV pool: at decode a
    token's keys and values are read from memory, a few hundred bytes per key scattered through
    the pool by its pages, each 4 KiB page a TLB entry to find)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return empty(nbytes).view(dtype).view(shape).zero_()


def _mappings() -> list[tuple[int, int, dict[str, int]]]:
    """(start, end, {field: number}) of every memory mapping of this process (/proc/self/smaps,
    kB fields in kB); [] where that cannot be read."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return []
    out: list[tuple[int, int, dict[str, int]]] = []
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if not parts[0].endswith(":") and "-" in parts[0]:  # "lo-hi perms offset dev inode"
            lo, hi = (int(a, 16) for a in parts[0].split("-"))
            out.append((lo, hi, {}))
        elif out and len(parts) >= 2 and parts[1].isdigit():
            out[-1][2][parts[0].rstrip(":")] = int(parts[1])
    return out


def _mapping_of(addr: int, maps) -> dict[str, int]:
    return next((f for lo, hi, f in maps if lo <= addr < hi), {})


def huge_bytes(t: torch.Tensor) -> int:
    """Bytes of the memory mapping that holds `t`'s data which the kernel keeps in huge pages
    (AnonHugePages; the mapping can be larger than `t`); 0 where that cannot be read."""
    return _mapping_of(t.data_ptr(), _mappings()).get("AnonHugePages", 0) * 1024


def huge_eligible(t: torch.Tensor) -> bool:
    """Whether the kernel may back `t`'s mapping with huge pages (its THPeligible flag, set by
    `empty`'s madvise): what `empty` asked for, whether or not free huge pages were found."""
    return _mapping_of(t.data_ptr(), _mappings()).get("THPeligible") == 1


# a decoder layer's weights in the order its forward reads them, fused or not
# (labkit.model.DecoderLayer; bench's linear_rate calls the linears in this order too)
READ_ORDER = ("input_norm", "qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj", "post_attn_norm",
              "gate_up_proj", "gate_proj", "up_proj", "down_proj")


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every CPU parameter and buffer of `model` once, in the order a step reads them: each
    layer's (`READ_ORDER`, then any other), then the rest (the embedding, the final
    norm, the head). A module that is not a decoder registers them in its own order."""
    rank = {n: i for i, n in enumerate(READ_ORDER)}
    named = []
    for layer in getattr(model, "layers", None) or []:
        mine = [*layer.named_parameters(), *layer.named_buffers()]
        named += sorted(mine, key=lambda nt: rank.get(nt[0].split(".")[0], len(rank)))
    named += [*model.named_parameters(), *model.named_buffers()]  # (the layers' are seen)
    seen: set[int] = set()
    out = []
    for _, t in named:
        if t is None or id(t) in seen or t.device.type != "cpu" or t.is_meta or not t.numel():
            continue  # (an empty tensor has no bytes to place: int4's dot layout's kscale)
        seen.add(id(t))
        out.append(t)
    return out


def _placed(t: torch.Tensor) -> int | None:
    """The key of the buffer `place_weights` put `t` in, None if it is not in one (a deep copy
    of a placed tensor carries its mark, not its place: the address tells)."""
    key = getattr(t, "_labkit_placed", None)
    if key is None or key not in _SPANS:
        return None
    lo, hi, _ = _SPANS[key]
    return key if lo <= t.data_ptr() < hi else None


_SPANS: dict[int, tuple[int, int, int]] = {}  # a buffer's key -> (first byte, end, the bytes
_KEYS = itertools.count(1)  # of the tensors placed in it)


def placement(model: torch.nn.Module) -> dict:
    """Where `model`'s CPU weights sit: {"bytes": all of them, "placed": those in buffers of
    `place_weights`, "huge_bytes": of those, the bytes in mappings the kernel keeps in huge
    pages (each mapping counted up to the model's bytes in it)}."""
    tensors = _tensors(model)
    placed = [t for t in tensors if _placed(t)]
    maps = _mappings() if placed else []
    per_map: dict[int, list[int]] = {}  # a mapping's start -> [the model's bytes, its huge bytes]
    for t in placed:
        lo = next((lo for lo, hi, _ in maps if lo <= t.data_ptr() < hi), None)
        if lo is not None:
            entry = per_map.setdefault(lo, [0, _mapping_of(lo, maps).get("AnonHugePages", 0)])
            entry[0] += t.numel() * t.element_size()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {"bytes": nbytes(tensors), "placed": nbytes(placed),
            "huge_bytes": sum(min(b, kb * 1024) for b, kb in per_map.values())}


def copied_together(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Copies of `tensors`, one after the other (each ALIGN-aligned) in one buffer from
    `empty`: (the buffer, the copies). What `place_weights` does to a model's weights, for
    tensors a benchmark wants where a step would find them."""
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-size(t) // ALIGN) * ALIGN
    buf = empty(end)
    with torch.no_grad():
        copies = [buf[off:off + size(t)].view(t.dtype).view(t.shape).copy_(t)
                  for t, off in zip(tensors, offsets)]
    return buf, copies


def place_weights(model: torch.nn.Module, min_bytes: int | None = None) -> dict:
    """Copy `model`'s CPU parameters and buffers into buffers from `empty`, in the model's
    order, and point the model at the copies: one buffer for all but the largest tensors (LARGE
    bytes and more: one each). A Parameter keeps its identity, so a model sharing it (two loads
    of one GGUF share their fp32 weights) reads the copy too. A tensor placed before stays where
    it is, unless `model` holds only part of that tensor's buffer (a quantized model keeps the
    fp32 model's norms): then `model` gets its own copy, so that it never keeps another model's
    buffer in memory for a part of it. Nothing moves for fewer than `min_bytes` (None:
    MIN_BYTES). Returns `placement`'s dict with "moved" (the bytes copied now) and "skipped"
    (why nothing moved, else None)."""
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    why = huge_pages()
    tensors = _tensors(model)
    held: dict[int, int] = {}  # key -> this model's bytes in that buffer
    for t in tensors:
        if (key := _placed(t)) is not None:
            held[key] = held.get(key, 0) + t.numel() * t.element_size()
    # a part of another buffer: copied, and the copy replaces it in this model only
    apart = {id(t) for t in tensors
             if (key := _placed(t)) is not None and held[key] < _SPANS[key][2]}
    todo = [t for t in tensors if _placed(t) is None or id(t) in apart]
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    total = sum(size(t) for t in todo)
    if why is None and total < min_bytes:
        why = f"{total / 2**20:.1f} MiB of weights, below {min_bytes / 2**20:.0f} MiB"
    if why is not None or not todo:
        return {**placement(model), "moved": 0, "skipped": why or "every weight placed before"}
    groups = [[t] for t in todo if size(t) >= LARGE]
    groups.append([t for t in todo if size(t) < LARGE])
    copies: dict[int, torch.Tensor] = {}
    for group in groups:
        if not group:
            continue
        buf, placed = copied_together(group)
        key = next(_KEYS)
        _SPANS[key] = (buf.data_ptr(), buf.data_ptr() + buf.numel(), sum(size(t) for t in group))
        for t, c in zip(group, placed):
            c._labkit_placed = key
            copies[id(t)] = c
    for mod in model.modules():
        for name, t in list(mod._parameters.items()):
            if t is None or id(t) not in copies:
                continue
            c = copies[id(t)]
            if id(t) in apart:  # this model's own Parameter; the other model keeps its own
                new = torch.nn.Parameter(c, requires_grad=t.requires_grad)
                new._labkit_placed = c._labkit_placed
                mod._parameters[name] = new
            else:  # the same Parameter object, its data moved (for every model holding it)
                t.data = c
                t._labkit_placed = c._labkit_placed
        for name, t in list(mod._buffers.items()):
            if t is not None and id(t) in copies:
                mod._buffers[name] = copies[id(t)]
    from labkit.kernels import stack  # a layer stack built before holds the tensors it read

    stack.forget(model)
    return {**placement(model), "moved": total, "skipped": None}
