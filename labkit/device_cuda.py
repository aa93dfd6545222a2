"""The device on an NVIDIA GPU: CUDA streams, events, pinned buffers, CUDA graphs.

The same four launches as every labkit device (see labkit/device.py), mapped onto CUDA:

- one **compute stream** runs every forward and every sample, in launch order;
- one **copy stream** waits on the sample's event, then copies the sampled tokens into a
  **pinned** (page-locked) host buffer with `non_blocking=True`, so the copy is a background DMA
  that never holds up the compute stream;
- the host waits on the copy's event only when it commits that step;
- each decode forward can be captured once per (batch, context) bucket in a **CUDA graph**, so a
  launch is one `replay()` instead of hundreds of kernel launches that the host would otherwise
  issue one by one (host time the pipeline has to hide).

Nothing a step launches reads the device back (no `.item()`, no `nonzero`): the host knows
every length from the plan. `LABKIT_CUDA_GRAPHS=0` turns the graphs off; a bucket whose capture
fails runs eager (and says so once). Everything here needs a GPU; tests marked `cuda` exercise
it and skip cleanly without one, and tests/test_fake_cuda.py runs it on a CPU with fake
streams, events and graphs that raise on any sync inside a captured step.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import time
from collections import OrderedDict, deque

import numpy as np
import torch

from labkit.attention import AttentionMeta
from labkit.device import NUM_SLOTS, Device, check_no_verify
from labkit.quant import relayout
from labkit.runner import ModelRunner, StepPlan
from labkit.sampling import MAX_LOGPROBS, Drafts, History

log = logging.getLogger(__name__)


def graphs_enabled() -> bool:
    """CUDA graphs on, unless the environment says LABKIT_CUDA_GRAPHS=0."""
    return os.environ.get("LABKIT_CUDA_GRAPHS", "1") != "0"


def _bucket(n: int, smallest: int) -> int:
    """The next power of two >= n (and >= smallest)."""
    b = smallest
    while b < n:
        b *= 2
    return b


def decode_step(runner: ModelRunner, rows: torch.Tensor, starts: torch.Tensor,
                tables: torch.Tensor, max_ctx: int) -> torch.Tensor:
    """The decode forward a graph captures: B rows, one token each, logits [B, V].

    Its inputs are device buffers a replay refills (rows [B], starts [B], block tables [B, W]);
    every shape comes from the host (B, `max_ctx`), so nothing reads the device back: what a
    CUDA graph needs, and what tests/test_fake_cuda.py checks on the meta device.
    """
    b = rows.shape[0]
    meta = AttentionMeta.build(torch.ones_like(starts), starts, tables, runner.cache.block_size,
                               1, max_ctx, host_query_lens=[1] * b)
    runner.backend.begin_step(meta)
    return runner.model(runner.last_tokens[rows], meta.positions, runner.backend,
                        logit_rows=meta.last_rows)


class DecodeGraphs:
    """Decode forwards captured as CUDA graphs, one per (batch bucket, context bucket).

    A graph replays fixed shapes on fixed buffers, so a step of B rows with longest context L
    runs in the graph of (B', L') = the next powers of two. Padded rows attend over, and write
    into, a scratch page that no sequence owns.
    """

    def __init__(self, runner: ModelRunner, stream: torch.cuda.Stream,
                 max_batch: int | None = None):
        self.runner, self.stream = runner, stream
        # the most rows a step has (the engine's max_seqs; the device holds more rows than
        # that, for zombies)
        self.max_batch = max_batch or runner.last_tokens.shape[0]
        self.scratch_page = runner.scratch_page  # owned by no sequence
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.failed: dict[tuple[int, int], str] = {}  # buckets that run eager, and why
        self.pool = None

    @torch.inference_mode()
    def _capture(self, b: int, ctx: int):
        r = self.runner
        width = -(-ctx // r.cache.block_size)
        dev = r.device
        rows = torch.zeros(b, dtype=torch.long, device=dev)
        starts = torch.zeros(b, dtype=torch.long, device=dev)
        tables = torch.full((b, width), self.scratch_page, dtype=torch.long, device=dev)
        torch.cuda.synchronize()  # the buffers above were made on the default stream
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # warm up (allocations, kernel selection) before capturing
                decode_step(r, rows, starts, tables, ctx)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            logits = decode_step(r, rows, starts, tables, ctx)
        self.pool = graph.pool()
        return graph, rows, starts, tables, logits

    def bucket(self, plan: StepPlan) -> tuple[int, int]:
        """The (batch, context) graph a decode plan runs in: powers of two, capped by the
        most rows a step has and the model's context (a batch of max_seqs rows is graphed
        too)."""
        r = self.runner
        ctx = max(plan.starts) + 1
        return (min(_bucket(len(plan.rows), 1), self.max_batch),
                min(_bucket(ctx, 64), r.cfg.max_position))

    @torch.inference_mode()
    def forward(self, plan: StepPlan, on_staged=None) -> torch.Tensor | None:
        """Replay the graph for a decode plan (None if it has no graph-able shape, or its
        bucket's capture failed: the caller runs it eager). `on_staged()` is called once the
        graph's inputs are enqueued, just before the replay."""
        r = self.runner
        if plan.kind != "decode" or r.cache_kind != "paged" or r.attention != "paged":
            return None
        key = self.bucket(plan)
        if key in self.failed:
            return None
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(*key)
            except Exception as err:  # noqa: BLE001 - any capture failure: run eager
                self.failed[key] = f"{type(err).__name__}: {err}"
                log.warning("CUDA graph capture failed for bucket (batch %d, context %d); "
                            "that bucket runs eager from now on: %s", *key, self.failed[key])
                torch.cuda.synchronize()  # whatever the failed capture left enqueued
                return None
        graph, rows, starts, tables, logits = self.graphs[key]
        b = len(plan.rows)
        pad = key[0] - b
        width = tables.shape[1]
        scratch = self.scratch_page
        # a table may hold pages reserved for tokens to come: the bucket needs only `width`
        host_tables = [t[:width] + [scratch] * (width - len(t[:width]))
                       for t in plan.block_tables]
        host_tables += [[scratch] * width] * pad
        # fill the graph's input buffers (pinned staging, asynchronous), then replay
        rows.copy_(r.to_device(plan.rows + [0] * pad), non_blocking=True)
        starts.copy_(r.to_device(plan.starts + [0] * pad), non_blocking=True)
        tables.copy_(r.to_device(host_tables), non_blocking=True)
        r.copy_pages(plan.copies)  # copy-on-write, before the step writes the copies
        if on_staged is not None:
            on_staged()
        graph.replay()
        return logits[:b]  # a view of the graph's static buffer: the next replay rewrites it

    def reset(self) -> None:
        """Free every captured graph and the memory pool they share."""
        for graph, *_ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.pool = None


class MaskCache:
    """Constraint masks on the device, keyed by their content, least recently used dropped.

    A constraint hands the same host mask object to every step that reaches its state, so the
    content key (a hash of the packed bits) is computed once per object: `_keys` remembers it by
    `id()`, and holds the object, so that id cannot be reused by another mask while remembered.
    Keyed by content, two objects with the same bits share one upload, and a mask rebuilt after
    its constraint cleared its own cache is found again, never a stale one under a reused id.
    """

    def __init__(self, device: torch.device, capacity: int = 1024):
        self.device, self.capacity = device, capacity
        self._keys: OrderedDict[int, tuple[torch.Tensor, bytes]] = OrderedDict()
        self._masks: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._masks)

    def _key(self, mask: torch.Tensor) -> bytes:
        hit = self._keys.get(id(mask))
        if hit is not None and hit[0] is mask:
            self._keys.move_to_end(id(mask))
            return hit[1]
        bits = np.packbits(mask.numpy())  # [V / 8] bytes
        key = mask.shape[0].to_bytes(8, "little") + hashlib.blake2b(
            bits.tobytes(), digest_size=16).digest()
        self._keys[id(mask)] = (mask, key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return key

    def get(self, mask: torch.Tensor) -> torch.Tensor:
        """The device copy of a host bool mask [V] (uploaded on first use, on the current
        stream, through pinned memory)."""
        key = self._key(mask)
        dev = self._masks.get(key)
        if dev is None:
            dev = mask.pin_memory().to(self.device, non_blocking=True)
            self._masks[key] = dev
            if len(self._masks) > self.capacity:
                # freed on the host, reused by the caching allocator only in stream order
                self._masks.popitem(last=False)
        else:
            self._masks.move_to_end(key)
        return dev

    def clear(self) -> None:
        """Drop every cached mask."""
        self._keys.clear()
        self._masks.clear()


class CudaDevice(Device):
    """Streams, events and pinned buffers on a real GPU."""

    simulated = False

    def __init__(self, model, num_blocks: int, block_size: int, max_seqs: int,
                 cache: str = "paged", use_graphs: bool = True, attention: str | None = None,
                 max_batch: int | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevice needs an NVIDIA GPU; on this machine use "
                               "device='process' (the simulated accelerator)")
        dev = torch.device("cuda")
        self.name = torch.cuda.get_device_name(dev)
        model = copy.deepcopy(model).to(dev)  # the caller's CPU model stays as it was
        relayout(model)  # quantized linears: the CUDA kernels' layout, not the CPU's
        # the runner adds the scratch page padded graph rows write into
        self.runner = ModelRunner(model, num_blocks, block_size, max_seqs, cache, dev,
                                  attention)
        self.compute = torch.cuda.Stream(dev)
        self.copy = torch.cuda.Stream(dev)
        # LABKIT_CUDA_GRAPHS=0: all eager; the contiguous cache is never graphed (its
        # attention loops over rows in Python)
        use_graphs = use_graphs and graphs_enabled() and cache == "paged"
        self.graphs = (DecodeGraphs(self.runner, self.compute, max_batch) if use_graphs
                       else None)
        self.host = [torch.zeros(max_seqs, dtype=torch.long, pin_memory=True)
                     for _ in range(NUM_SLOTS)]
        self.sampled = [torch.cuda.Event() for _ in range(NUM_SLOTS)]
        self.copied = [torch.cuda.Event() for _ in range(NUM_SLOTS)]
        self._logits: list[torch.Tensor | None] = [None] * NUM_SLOTS
        self._tokens: list[torch.Tensor | None] = [None] * NUM_SLOTS
        self._n = [0] * NUM_SLOTS  # rows of the step in each slot
        # log-probabilities come back in the same copy, into pinned rows of their own
        self.host_logprobs = [torch.zeros(max_seqs, 1 + 2 * MAX_LOGPROBS, pin_memory=True)
                              for _ in range(NUM_SLOTS)]
        self._logprobs: list[torch.Tensor | None] = [None] * NUM_SLOTS
        self._step = [0] * NUM_SLOTS  # and its step number, for the timeline
        self._masks = MaskCache(dev)  # constraint masks kept on the device
        self._closed = False
        # device spans: timing events, mapped to the host clock through one base event
        # (a bounded deque: a long run nobody records keeps only its latest spans)
        self._pending: deque = deque(maxlen=1 << 14)
        torch.cuda.synchronize()
        self._base = torch.cuda.Event(enable_timing=True)
        self._base.record()
        self._base.synchronize()
        self._base_s = time.perf_counter()

    def _timed(self, stream: torch.cuda.Stream):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def launch_forward(self, slot: int, plan: StepPlan) -> None:
        check_no_verify(self, plan)
        # a graphed forward's logits live in its graph's static buffer, which the next replay
        # of that bucket rewrites: every earlier forward must have been sampled by now
        unsampled = [s for s, lg in enumerate(self._logits) if lg is not None]
        assert not unsampled, (
            f"step {plan.step}: forward launched while slot {unsampled} still holds logits "
            "not sampled; a graph replay would overwrite them (launch, then sample, per step)")
        t0: list = []

        def staged():  # the span starts once the inputs are on the device, not before
            t0.append(self._timed(self.compute))
        with torch.cuda.stream(self.compute):
            logits = (self.graphs.forward(plan, staged) if self.graphs is not None else None)
            if logits is None:
                t0.clear()
                logits = self.runner.forward(plan, on_staged=staged)
            self._logits[slot] = logits
            self._pending.append(("compute", "forward", plan.step, t0[0],
                                  self._timed(self.compute)))

    def launch_sample(self, slot: int, plan: StepPlan,
                      allowed: dict[int, torch.Tensor] | None = None,
                      history: History | None = None, drafts: Drafts | None = None) -> None:
        t0: list = []
        with torch.cuda.stream(self.compute):
            mask = None
            if allowed:
                vocab = self._logits[slot].shape[-1]
                mask = torch.ones(plan.batch_size, vocab, dtype=torch.bool,
                                  device=self.runner.device)
                for row, m in allowed.items():
                    mask[row] = self._masks.get(m)  # uploaded once per distinct mask
            self._tokens[slot] = self.runner.sample(
                plan, self._logits[slot], mask,
                on_staged=lambda: t0.append(self._timed(self.compute)), history=history)
            self._logprobs[slot] = self.runner.last_logprobs
            self._logits[slot] = None
            self.sampled[slot].record(self.compute)
            self._pending.append(("compute", "sample", plan.step, t0[0],
                                  self._timed(self.compute)))
        self._n[slot] = plan.batch_size
        self._step[slot] = plan.step

    def launch_copy(self, slot: int) -> None:
        n = self._n[slot]
        with torch.cuda.stream(self.copy):
            self.copy.wait_event(self.sampled[slot])  # after the sample, not before
            t0 = self._timed(self.copy)
            self.host[slot][:n].copy_(self._tokens[slot], non_blocking=True)  # DMA to pinned
            self._tokens[slot].record_stream(self.copy)  # memory used by a second stream
            lp = self._logprobs[slot]
            if lp is not None:
                self.host_logprobs[slot][:n, :lp.shape[1]].copy_(lp, non_blocking=True)
                lp.record_stream(self.copy)
            self.copied[slot].record(self.copy)
            self._pending.append(("copy", "copy", self._step[slot], t0,
                                  self._timed(self.copy)))

    def wait_tokens(self, slot: int) -> list[int]:
        self.copied[slot].synchronize()
        return self.host[slot][:self._n[slot]].tolist()

    def logprobs(self, slot: int) -> list[list[float]] | None:
        lp = self._logprobs[slot]  # its copy is done: wait_tokens waited for the same event
        if lp is None:
            return None
        return self.host_logprobs[slot][:self._n[slot], :lp.shape[1]].tolist()

    def spans(self) -> list[tuple[str, str, int, float, float]]:
        torch.cuda.synchronize()
        out = [(lane, op, step, self._base_s + self._base.elapsed_time(a) / 1e3,
                self._base_s + self._base.elapsed_time(b) / 1e3)
               for lane, op, step, a, b in self._pending]
        self._pending.clear()
        return out

    def close(self) -> None:
        """Wait for the device, free the graphs and their pool, the masks and the buffers."""
        if self._closed:
            return
        self._closed = True
        torch.cuda.synchronize()
        if self.graphs is not None:
            self.graphs.reset()
        self._masks.clear()
        self._logits = [None] * NUM_SLOTS
        self._tokens = [None] * NUM_SLOTS
        self._logprobs = [None] * NUM_SLOTS
        self._pending.clear()
        torch.cuda.empty_cache()  # the pools' memory goes back to the driver
