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

Everything here needs a GPU; tests marked `cuda` exercise it and skip cleanly without one.
"""

from __future__ import annotations

import copy
import time
from collections import deque

import torch

from labkit.attention import AttentionMeta
from labkit.device import NUM_SLOTS, Device
from labkit.runner import ModelRunner, StepPlan


def _bucket(n: int, smallest: int) -> int:
    """The next power of two >= n (and >= smallest)."""
    b = smallest
    while b < n:
        b *= 2
    return b


class DecodeGraphs:
    """Decode forwards captured as CUDA graphs, one per (batch bucket, context bucket).

    A graph replays fixed shapes on fixed buffers, so a step of B rows with longest context L
    runs in the graph of (B', L') = the next powers of two. Padded rows attend over, and write
    into, a scratch page that no sequence owns.
    """

    def __init__(self, runner: ModelRunner, stream: torch.cuda.Stream):
        self.runner, self.stream = runner, stream
        self.scratch_page = runner.scratch_page  # owned by no sequence
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool = None

    def _capture(self, b: int, ctx: int):
        r = self.runner
        bs = r.cache.block_size
        width = -(-ctx // bs)
        dev = r.device
        rows = torch.zeros(b, dtype=torch.long, device=dev)
        starts = torch.zeros(b, dtype=torch.long, device=dev)
        tables = torch.full((b, width), self.scratch_page, dtype=torch.long, device=dev)

        def step():
            meta = AttentionMeta.build(torch.ones_like(starts), starts, tables, bs, 1, ctx)
            r.backend.begin_step(meta)
            return r.model(r.last_tokens[rows], meta.positions, r.backend,
                           logit_rows=meta.last_rows)

        torch.cuda.synchronize()  # the buffers above were made on the default stream
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # warm up (allocations, kernel selection) before capturing
                step()
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            logits = step()
        self.pool = graph.pool()
        return graph, rows, starts, tables, logits

    def forward(self, plan: StepPlan) -> torch.Tensor | None:
        """Replay the graph for a decode plan (None if it has no graph-able shape)."""
        r = self.runner
        if plan.kind != "decode" or r.cache_kind != "paged" or r.attention != "paged":
            return None
        b = len(plan.rows)
        ctx = max(plan.starts) + 1
        key = (_bucket(b, 1), _bucket(ctx, 64))
        if key[0] > r.last_tokens.shape[0] or key[1] > r.cfg.max_position:
            return None
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, rows, starts, tables, logits = self.graphs[key]
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
        graph.replay()
        return logits[:b]


class CudaDevice(Device):
    """Streams, events and pinned buffers on a real GPU."""

    simulated = False

    def __init__(self, model, num_blocks: int, block_size: int, max_seqs: int,
                 cache: str = "paged", use_graphs: bool = True, attention: str | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevice needs an NVIDIA GPU; on this machine use "
                               "device='process' (the simulated accelerator)")
        dev = torch.device("cuda")
        self.name = torch.cuda.get_device_name(dev)
        model = copy.deepcopy(model).to(dev)  # the caller's CPU model stays as it was
        # the runner adds the scratch page padded graph rows write into
        self.runner = ModelRunner(model, num_blocks, block_size, max_seqs, cache, dev,
                                  attention)
        self.compute = torch.cuda.Stream(dev)
        self.copy = torch.cuda.Stream(dev)
        self.graphs = DecodeGraphs(self.runner, self.compute) if use_graphs else None
        self.host = [torch.zeros(max_seqs, dtype=torch.long, pin_memory=True)
                     for _ in range(NUM_SLOTS)]
        self.sampled = [torch.cuda.Event() for _ in range(NUM_SLOTS)]
        self.copied = [torch.cuda.Event() for _ in range(NUM_SLOTS)]
        self._logits: list[torch.Tensor | None] = [None] * NUM_SLOTS
        self._tokens: list[torch.Tensor | None] = [None] * NUM_SLOTS
        self._n = [0] * NUM_SLOTS  # rows of the step in each slot
        self._step = [0] * NUM_SLOTS  # and its step number, for the timeline
        self._masks: dict[int, torch.Tensor] = {}  # constraint masks kept on the device
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
        with torch.cuda.stream(self.compute):
            t0 = self._timed(self.compute)
            logits = self.graphs.forward(plan) if self.graphs is not None else None
            self._logits[slot] = logits if logits is not None else self.runner.forward(plan)
            self._pending.append(("compute", "forward", plan.step, t0,
                                  self._timed(self.compute)))

    def launch_sample(self, slot: int, plan: StepPlan,
                      allowed: dict[int, torch.Tensor] | None = None) -> None:
        with torch.cuda.stream(self.compute):
            t0 = self._timed(self.compute)
            mask = None
            if allowed:
                vocab = self._logits[slot].shape[-1]
                mask = torch.ones(plan.batch_size, vocab, dtype=torch.bool,
                                  device=self.runner.device)
                for row, m in allowed.items():
                    if id(m) not in self._masks:  # first use: one upload, then cached
                        self._masks[id(m)] = m.pin_memory().to(self.runner.device,
                                                               non_blocking=True)
                    mask[row] = self._masks[id(m)]
            self._tokens[slot] = self.runner.sample(plan, self._logits[slot], mask)
            self._logits[slot] = None
            self.sampled[slot].record(self.compute)
            self._pending.append(("compute", "sample", plan.step, t0,
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
            self.copied[slot].record(self.copy)
            self._pending.append(("copy", "copy", self._step[slot], t0,
                                  self._timed(self.copy)))

    def wait_tokens(self, slot: int) -> list[int]:
        self.copied[slot].synchronize()
        return self.host[slot][:self._n[slot]].tolist()

    def spans(self) -> list[tuple[str, str, int, float, float]]:
        torch.cuda.synchronize()
        out = [(lane, op, step, self._base_s + self._base.elapsed_time(a) / 1e3,
                self._base_s + self._base.elapsed_time(b) / 1e3)
               for lane, op, step, a, b in self._pending]
        self._pending.clear()
        return out
