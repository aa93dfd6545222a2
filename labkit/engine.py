"""The engine: requests in, completions out; the step pieces every decoder shares.

An `Engine` holds one model on one device with its scheduler and tokenizer. The decoders
(`decode_blocking`, `decode_pipelined`) are loops over the same pieces defined here:

- `plan_step()`: what the next launch computes: the scheduler's rows (decode rows of running
  sequences, prefill chunks of admitted ones, under the step's token budget) as a `StepPlan`;
- `launch(launch, slot)`: count the step in each sequence's `inflight_refs`, hand its forward
  to the device into decode slot `slot`;
- `finish_sampling(launch)`: masks from each sequence's constraint state *now* (`allowed`),
  sample on the device, start the copy of the tokens to the host;
- `wait_tokens(launch)`: the host waits for that copy;
- `commit(launch, tokens)`: append the tokens of rows that emit one, detokenize, check stop
  conditions, release. Rows of finished sequences (zombies), non-final prefill chunks (silent
  rows) and static batching's padding rows are skipped and counted in `engine.stats`.

Speculative requests (`SamplingParams.speculative`, labkit.speculative) add one piece before
the plan: their proposer drafts k tokens (`_propose`), the scheduler plans a *verify row* (the
last committed token and the draft, one chunk), the device samples all k + 1 positions, and
commit keeps the accepted run (`_commit_verify`), then rolls the KV back to it. The pipelined
loop refuses them: it plans step t+1 before commit t says where step t+1 starts.

The engine does not choose a decoder: `labkit.decoders.run(engine, "pipelined")` does, one
layer up, and `labkit.generate(...)` is the one-call front door.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from labkit.device import Device, InProcessDevice, ProcessDevice
from labkit.paged_kv import BlockAllocator
from labkit.runner import ModelRunner, StepPlan, contiguous_row_len, max_seq_len
from labkit.sampling import Drafts, History, SamplingParams, unpack_logprobs
from labkit.scheduler import RequestError, Row, Scheduler
from labkit.sequence import FinishReason, Sequence, commit_row
from labkit.speculative import (
    RERANK,
    DraftModel,
    PromptLookup,
    Proposal,
    Proposer,
    accept_greedy,
    exact_head,
)

TextCallback = Callable[[int, str], None]  # (request index, newly decoded text)


@dataclass
class Completion:
    """The result of one request."""

    index: int
    prompt: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    ttft_s: float  # arrival to first token
    token_times_s: list[float]  # arrival to each token
    error: str | None = None  # finish_reason "error": what raised while committing its token
    # SamplingParams.logprobs: per output token (its log-probability, [(id, log-probability)]
    # of the most likely), from the model's own distribution
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    sample: int = 0  # parallel sampling: which of the prompt's n answers

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (nan with fewer than 2 tokens)."""
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) >= 2 else float("nan")

    @property
    def e2e_s(self) -> float:
        """Arrival to last token (nan if it never got one)."""
        return self.token_times_s[-1] if self.token_times_s else float("nan")

    @property
    def inter_token_s(self) -> list[float]:
        """Gaps between consecutive tokens."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]


STEP_TOKENS_KEPT = 10_000  # EngineStats.step_tokens keeps the latest launches only


@dataclass
class EngineStats:
    """What the engine did, cumulative since it was made or last `reset()`."""

    steps: int = 0  # launches
    decode_rows: int = 0  # decode rows launched (one token each, fed back on the device)
    prefill_tokens: int = 0  # prompt (or recomputed) tokens computed, chunks included
    prefill_tokens_saved: int = 0  # prompt tokens served from shared prefix pages
    pages_saved: int = 0  # page allocations avoided by prefix sharing and by forks
    cow_copies: int = 0  # shared pages copied at a sequence's first write (copy-on-write)
    preemptions: int = 0  # sequences preempted (their context recomputed later)
    zombie_rows: int = 0  # rows skipped at commit because their sequence had finished
    silent_rows: int = 0  # non-final prefill chunk rows (their sampled token discarded)
    padding_rows: int = 0  # static batching: rows of finished members kept as padding
    peak_pages_used: int = 0  # most KV pages held at once
    peak_running: int = 0  # most sequences running (admitted, unfinished) at once
    # speculative decoding (labkit.speculative)
    verify_rows: int = 0  # verify rows launched (the last token plus k drafted ones each)
    draft_tokens: int = 0  # drafted tokens those rows checked
    accepted_tokens: int = 0  # drafted tokens the target accepted
    draft_pages_returned: int = 0  # pages that held only rejected positions, returned
    draft_s: float = 0.0  # host time spent proposing (the draft model's launches included)
    step_tokens: list[int] = field(default_factory=list)  # tokens of each launch (latest 10k)
    step_rows: list[int] = field(default_factory=list)  # rows (sequences) of each launch, alike

    def reset(self) -> None:
        """Start counting again from zero."""
        fresh = EngineStats()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))


@dataclass
class Launch:
    """A launched step: its plan and the scheduler's rows (host side only)."""

    plan: StepPlan
    rows: list[Row]
    slot: int = 0
    launched_s: float = field(default_factory=time.perf_counter)
    # how far it got, so that a loop ended by an exception can finish it (`Engine.settle`)
    launched: bool = False
    sampled: bool = False
    committed: bool = False
    logprobs: list[list[float]] | None = None  # from the device with its tokens, if asked

    @property
    def seqs(self) -> list[Sequence]:
        """The sequence of each row."""
        return [r.seq for r in self.rows]


def make_device(kind: str, model, num_blocks: int, block_size: int, max_seqs: int,
                cache: str = "paged", attention: str | None = None,
                max_batch: int | None = None) -> Device:
    """A device by name: "inprocess", "process" (simulated accelerator) or "cuda"; `max_seqs`:
    its rows (sequences it holds a last token for; a contiguous cache's slabs); `max_batch`:
    the most rows a step has (default: max_seqs)."""
    if kind == "inprocess":
        return InProcessDevice(ModelRunner(model, num_blocks, block_size, max_seqs, cache,
                                           attention=attention))
    if kind == "process":
        return ProcessDevice(model, num_blocks, block_size, max_seqs, cache,
                             attention=attention)
    if kind == "cuda":
        from labkit.device_cuda import CudaDevice  # imported on use: CPU machines skip it

        return CudaDevice(model, num_blocks, block_size, max_seqs, cache, attention=attention,
                          max_batch=max_batch)
    raise ValueError(f"device must be 'inprocess', 'process' or 'cuda', got {kind!r}")


def check_engine_settings(**settings) -> None:
    """Refuse engine settings that could never run a request, naming the setting."""
    for name, v in settings.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"Engine: {name} must be an integer, got {v!r}")
    for name in ("block_size", "max_seqs"):
        if settings[name] < 1:
            raise ValueError(f"Engine: {name} must be >= 1, got {settings[name]} (max_seqs is "
                             "the most requests a step can hold; block_size the tokens per page)")
    if settings["num_adapter_slots"] < 0:
        raise ValueError(f"Engine: num_adapter_slots must be >= 0, got "
                         f"{settings['num_adapter_slots']}")
    if settings["kv_tokens"] < settings["block_size"]:
        raise ValueError(f"Engine: kv_tokens ({settings['kv_tokens']}) is below one KV page "
                         f"(block_size {settings['block_size']}): no request could ever run")


class Engine:
    """One model, one device, a scheduler, a tokenizer."""

    def __init__(self, model, tokenizer=None, *, kv_tokens: int = 16384, block_size: int = 16,
                 max_seqs: int = 64, cache: str = "paged", num_adapter_slots: int = 4,
                 device: str = "inprocess", attention: str | None = None,
                 max_step_tokens: int | None = 512,
                 batching: str = "continuous", kv_reserve: str = "on_demand",
                 prefix_caching: bool = True, drafts: dict | None = None,
                 draft_rerank: int = RERANK, foresee_finishes: bool = False):
        # attention: "naive", "paged" or "flash" (labkit.attention.BACKENDS); None picks the
        # cache's own ("paged" for the paged pool, "naive" for the contiguous slabs).
        # drafts: speculative decoding's draft models by proposer name ({"int4": the model's
        # int4 copy}); prompt lookup ("ngram") needs none. draft_rerank: a draft's head's top
        # candidates per row rescored with this model's own head rows (0: its own head alone;
        # labkit.speculative.RerankedHead).
        # foresee_finishes: the pipelined loop plans no row after a sequence's last token by
        # length (no zombie row for it, and its place goes to a waiting request one step
        # earlier); off, every finish is found at commit, as in Photon's loop (chapter 07)
        check_engine_settings(kv_tokens=kv_tokens, block_size=block_size, max_seqs=max_seqs,
                              num_adapter_slots=num_adapter_slots)
        if isinstance(draft_rerank, bool) or not isinstance(draft_rerank, int) or draft_rerank < 0:
            raise ValueError(f"Engine: draft_rerank must be an integer >= 0 (candidates a draft "
                             f"rescores with the model's head; 0: none), got {draft_rerank!r}")
        num_blocks = kv_tokens // block_size
        self.model, self.tokenizer = model, tokenizer
        self.stats = EngineStats()
        contiguous = cache == "contiguous"  # one max-length slab per sequence: reserve it all
        # a sequence that finished at step t keeps its device row until its zombie row in step
        # t + 1 commits (the pipelined decoder): with a row each for as many zombies as there
        # can be, a waiting request starts in the first step planned after the finish, as in
        # the blocking loop, not one step later (measured on the capstone's SmolLM2 workload:
        # 127 launches against the blocking loop's 120 with max_seqs rows). A contiguous
        # cache's rows are slabs of the pool: there a zombie's row still waits.
        device_rows = max_seqs if contiguous else 2 * max_seqs
        scheduler = Scheduler(
            BlockAllocator(num_blocks), block_size, max_seqs,
            max_seq_len(model.cfg, cache, num_blocks, block_size, max_seqs), num_adapter_slots,
            max_step_tokens=max_step_tokens, batching=batching,
            kv_reserve="max" if contiguous else kv_reserve,
            prefix_caching=prefix_caching and not contiguous,
            reserve_tokens=contiguous_row_len(num_blocks, block_size, max_seqs)
            if contiguous else None, stats=self.stats, device_rows=device_rows,
            foresee_finishes=foresee_finishes)
        # (the scheduler checks its settings before the device starts)
        self.device: Device = make_device(device, model, num_blocks, block_size, device_rows,
                                          cache, attention, max_batch=max_seqs)
        self.scheduler = scheduler
        self.eos_id = tokenizer.eos_id if tokenizer is not None else None
        self.seqs: dict[int, Sequence] = {}
        self._next_id = 0
        # what-if knob for the cost model: extra pure-Python host work in every commit (s)
        self.extra_host_work_s = 0.0
        self.steps = 0  # launches so far (never reset: it numbers the steps)
        self.on_text: TextCallback | None = None
        self.on_step: Callable[[Engine], None] | None = None  # called between steps
        self.timeline = None  # a labkit.instruments.timeline.Timeline while one is recording
        self.interrupt_pending = False  # a deferred Ctrl-C, raised at the next between_steps
        # speculative decoding: a proposer per name; each keeps its own state per sequence
        self.proposers: dict[str, Proposer] = {"ngram": PromptLookup(model.cfg.vocab_size)}
        for name, draft in (drafts or {}).items():
            if name not in ("int4", "int8"):
                raise ValueError(f"Engine: drafts are named 'int4' or 'int8' (the proposer a "
                                 f"request names in SamplingParams.speculative), got {name!r}")
            if draft.cfg.vocab_size != model.cfg.vocab_size:
                raise ValueError(f"Engine: the {name} draft's vocabulary ({draft.cfg.vocab_size})"
                                 f" is not the model's ({model.cfg.vocab_size})")
            # the draft rescores its head's best candidates with the model's own head rows
            head = exact_head(model, draft) if draft_rerank > 0 else None
            self.proposers[name] = DraftModel(name, draft, num_blocks, block_size, max_seqs,
                                              attention, head=head, rerank=draft_rerank)
        self._proposals: dict[int, Proposal] = {}  # of the step being planned, by request

    @property
    def zombie_rows(self) -> int:
        """Rows skipped at commit because their sequence had finished (`stats.zombie_rows`)."""
        return self.stats.zombie_rows

    @property
    def decode_rows(self) -> int:
        """Decode rows launched (`stats.decode_rows`)."""
        return self.stats.decode_rows

    @functools.cached_property
    def vocab(self):
        """What each token id decodes to, for constrained decoding (built once, cached)."""
        from labkit.vocab import Vocab
        if self.tokenizer is None:
            raise RequestError("constraints need a tokenizer; this engine has none")
        return Vocab.from_tokenizer(self.tokenizer, size=self.model.cfg.vocab_size)

    # -- requests ------------------------------------------------------------------------------

    def check(self, prompt_ids: list[int], params: SamplingParams,
              constraint=None) -> int:
        """Everything `submit` checks, changing nothing; returns the request's token cap.

        Raises RequestError if the request could never run to completion: a token outside the
        vocabulary, a prompt or cap the pool or context cannot hold, a constrained answer that
        cannot finish in the context left after the prompt.
        """
        vocab = self.model.cfg.vocab_size
        if params.speculative is not None:
            self._check_speculative(params, constraint)
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the model's vocabulary "
                               f"[0, {vocab}) ({self.model.cfg.name})")
        max_new = params.max_new_tokens
        if constraint is not None:
            # a constrained answer always runs to completion, so that it always parses: every
            # token spells at least one character, and EOS may follow the last one
            need = constraint.max_text_len + 1
            room = self.scheduler.context_len - len(prompt_ids)
            if need > room:
                raise RequestError(
                    f"the constrained answer ({constraint!r}) may need {need} tokens, but the "
                    f"context of {self.scheduler.context_len} tokens leaves {max(room, 0)} after "
                    f"the prompt's {len(prompt_ids)}: it could not finish. Shorten the prompt "
                    "or the answer (fewer decimals)")
            max_new = max(max_new, need)
        return self.scheduler.check_request(prompt_ids, max_new)

    def _check_speculative(self, params: SamplingParams, constraint) -> None:
        """Refuse a speculative request this engine cannot verify, naming what is missing."""
        name, _ = params.draft
        if name not in self.proposers:
            have = ", ".join(sorted(self.proposers))
            raise RequestError(f"speculative={params.speculative!r} needs an {name} draft model; "
                               f"this engine has the proposers {have} (build it with "
                               f"Engine(..., drafts={{{name!r}: model}}) or labkit.get_engine("
                               f"..., drafts=({name!r},)))")
        if not self.device.speculative:
            raise RequestError(f"speculative decoding runs on the in-process device; this "
                               f"engine's is {self.device.name!r} (its host buffers carry one "
                               "token per row)")
        for what, bad in (("a constraint", constraint is not None),
                          ("penalties", params.penalized),
                          ("logprobs", params.logprobs is not None)):
            if bad:
                raise RequestError(f"speculative decoding does not combine with {what}: the "
                                   "verify row would need them per drafted position; drop one")

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
               adapter: int | None = None, constraint=None, fork_of: int | None = None) -> int:
        """Queue a request; returns its id. Raises RequestError if it can never run.

        `fork_of`: a queued request with the same prompt (and adapter) whose prompt this one
        shares, a sample of parallel sampling (`submit_samples`): its prompt is computed once,
        its pages shared until written.
        """
        params = params or SamplingParams()
        if params.n != 1:
            raise RequestError(f"submit queues one sequence, got n={params.n}: use "
                               "submit_samples (or labkit.generate) for parallel sampling")
        prompt_ids = [int(t) for t in prompt_ids]
        max_new = self.check(prompt_ids, params, constraint)
        parent = None
        if fork_of is not None:
            parent = self.seqs.get(fork_of)
            if parent is None or parent.prompt_ids != prompt_ids or parent.adapter != adapter:
                raise RequestError(f"fork_of={fork_of}: a fork needs a request of this engine "
                                   "with the same prompt and adapter")
        seq = Sequence(self._next_id, prompt_ids, params, max_new, adapter=adapter,
                       constraint=constraint, fork_of=parent)
        if parent is not None:
            parent.forks.append(seq)
        if constraint is not None:
            seq.constraint_state = constraint.start()
        if self.tokenizer is not None:
            seq.detok = self.tokenizer.detokenizer()
        self.scheduler.add(seq)
        self.seqs[seq.request_id] = seq
        self._next_id += 1
        return seq.request_id

    def submit_samples(self, prompt_ids: list[int], params: SamplingParams, *,
                       adapter: int | None = None, constraint=None) -> list[int]:
        """Queue `params.n` samples of one prompt (parallel sampling); returns their ids. The
        first is an ordinary request; the others fork from it, each with its own seed
        (`SamplingParams.sample`), so sample j is what a request with that seed would get."""
        self.check(prompt_ids, params.sample(0), constraint)  # nothing queued if it cannot run
        first = self.submit(prompt_ids, params.sample(0), adapter=adapter,
                            constraint=constraint)
        return [first] + [self.submit(prompt_ids, params.sample(j), adapter=adapter,
                                      constraint=constraint, fork_of=first)
                          for j in range(1, params.n)]

    def clear_prefix_cache(self) -> int:
        """Forget the KV of every cached prompt page (pages no request holds); returns how
        many. Pages that running requests share are left alone."""
        return self.scheduler.allocator.drop_cached()

    def cancel(self, request_id: int) -> bool:
        """Cancel a request at any moment; False if it had already finished."""
        if request_id not in self.seqs:
            if 0 <= request_id < self._next_id:  # finished, and its record dropped
                return False
            raise KeyError(f"cancel: no request with id {request_id} (ids so far: "
                           f"0..{self._next_id - 1})")
        seq = self.seqs[request_id]
        if seq.finalized:
            return False
        self.scheduler.finalize(seq, FinishReason.CANCELLED)
        return True

    # -- the step pieces -----------------------------------------------------------------------

    def plan_step(self, speculate: bool = True) -> Launch | None:
        """The next launch: the scheduler's rows as one StepPlan (None if nothing can run).

        `speculate`: let the proposers draft for speculative requests (verify rows); a loop
        that cannot commit a verify row before it plans the next step passes False, and a
        speculative request then raises RequestError."""
        t0 = time.perf_counter()
        sched = self.scheduler
        self._propose(speculate)
        try:
            rows = sched.schedule()
        finally:
            for s in sched.running:
                s.draft = None
        if not rows:
            return None
        tokens: list[int] = []
        for r in rows:
            if r.from_device:
                tokens.append(0)  # the device fills it in from last_tokens
            elif r.pad:
                tokens.append(0)  # anything: a padding row's token is never used
            elif r.draft is not None:  # the last committed token, then the drafted ones
                tokens.append(r.seq.context[r.start])
                tokens.extend(r.draft)
            else:
                tokens.extend(r.seq.context[r.start:r.start + r.n])
        devs = [r.from_device for r in rows]
        kind = "decode" if all(devs) else "prefill" if not any(devs) else "mixed"
        scratch = [sched.allocator.num_blocks]  # the runner's scratch page: padding writes it
        plan = StepPlan(self.steps, kind, [r.seq.row for r in rows], [r.n for r in rows],
                        [r.start for r in rows],
                        [scratch if r.pad else r.seq.block_table for r in rows],
                        None if kind == "decode" else tokens, [r.seq.params for r in rows],
                        devs if kind == "mixed" else None, copies=sched.copies,
                        sample_from=None if all(r.sample_from is None for r in rows) else
                        [i if r.sample_from is None else r.sample_from
                         for i, r in enumerate(rows)],
                        verify=None if all(r.draft is None for r in rows) else
                        [1 if r.draft is None else r.n for r in rows])
        launch = Launch(plan, rows)
        self._span("plan", launch, t0)
        return launch

    def _propose(self, speculate: bool) -> None:
        """Drafts for every decoding speculative request (`Sequence.draft`), at most k tokens
        and never past its max_new_tokens; the proposers drop what finished requests held."""
        sched = self.scheduler
        self._proposals = {}
        spec = [s for s in sched.running if s.params.speculative is not None]
        if not spec and not any(p.pages_held() for p in self.proposers.values()):
            return  # nothing speculative: plain decoding pays one scan of the running list
        live = {s.request_id for s in spec if not (s.finalized or s.preempted)}
        for proposer in self.proposers.values():
            proposer.release(live)
        want: dict[str, list[tuple[Sequence, int]]] = {}
        for s in spec:
            if s.request_id not in live or not s.decoding:
                continue
            if not speculate:
                raise RequestError(
                    f"request {s.request_id} asks for speculative decoding "
                    f"({s.params.speculative!r}), which runs on the blocking decoder: the "
                    "pipelined one plans step t+1 before step t's accepted tokens are known")
            name, k = s.params.draft
            k = min(k, s.max_new_tokens - len(s.output_ids) - 1)  # the last token is the target's
            if k >= 1:
                want.setdefault(name, []).append((s, k))
        t0 = time.perf_counter()
        for name, seqs in want.items():
            self._proposals.update(self.proposers[name].propose(seqs))
        if want:
            self.stats.draft_s += time.perf_counter() - t0
        for s in sched.running:
            if s.request_id in self._proposals:
                s.draft = self._proposals[s.request_id].tokens

    def drafts(self, launch: Launch) -> Drafts | None:
        """The draft tokens and their q of the launch's sampled verify rows (the rejection
        rule's inputs); greedy rows need none (they keep the longest matching prefix)."""
        out = {}
        for i, r in enumerate(launch.rows):
            if r.draft is not None and not r.seq.params.greedy:
                q = self._proposals[r.seq.request_id].probs
                out[i] = (r.draft, q[:len(r.draft)])
        return out or None

    def launch(self, launch: Launch, slot: int) -> None:
        """Hand a step to the device; every sequence in it gains an in-flight reference."""
        sched, plan, st = self.scheduler, launch.plan, self.stats
        alloc, bs = sched.allocator, sched.block_size
        for r in launch.rows:
            s = r.seq
            assert not s.released, f"request {s.request_id} launched after release"
            if not r.pad:  # the pages this step writes must be owned (and, when planned, by
                # it alone: the scheduler checked; a later row may share a page it fills)
                alloc.check_writable(s.block_table[r.start // bs:(r.start + r.n - 1) // bs + 1],
                                     shared_ok=True)
        for r in launch.rows:  # checked first, so a refused launch changes nothing
            r.seq.inflight_refs += 1
        launch.slot = slot
        launch.launched_s = time.perf_counter()
        try:
            self.device.launch_forward(slot, plan)
        except BaseException:  # never reached the device: nothing references the sequences
            for r in launch.rows:
                r.seq.inflight_refs -= 1
            raise
        launch.launched = True
        self.steps += 1
        st.steps += 1
        st.decode_rows += sum(r.from_device for r in launch.rows)
        st.prefill_tokens += sum(r.n for r in launch.rows if not (r.from_device or r.pad or
                                                                   r.draft is not None))
        if launch.plan.verify is not None:
            verify = [r for r in launch.rows if r.draft is not None]
            st.verify_rows += len(verify)
            st.draft_tokens += sum(len(r.draft) for r in verify)
        st.step_tokens.append(plan.num_tokens)
        st.step_rows.append(plan.batch_size)
        if len(st.step_tokens) > 2 * STEP_TOKENS_KEPT:
            del st.step_tokens[:-STEP_TOKENS_KEPT]
            del st.step_rows[:-STEP_TOKENS_KEPT]
        st.peak_pages_used = max(st.peak_pages_used, alloc.num_used)
        st.peak_running = max(st.peak_running, len(sched.live()))
        self._span(plan.kind, launch, launch.launched_s)  # "prefill", "decode" or "mixed"

    def wait_tokens(self, launch: Launch) -> list[int]:
        """Block until the launch's tokens are in its slot's host buffer; return them."""
        t0 = time.perf_counter()
        tokens = self.device.wait_tokens(launch.slot)
        launch.logprobs = self.device.logprobs(launch.slot)
        self._span("wait", launch, t0)
        return tokens

    def _span(self, label: str, launch: Launch, t0: float) -> None:
        if self.timeline is not None:
            self.timeline.add("host", label, launch.plan.step, t0, time.perf_counter())

    def allowed(self, launch: Launch) -> dict[int, torch.Tensor] | None:
        """Masks for constrained rows, from each sequence's constraint state now."""
        masks = {}
        for i, r in enumerate(launch.rows):
            s = r.seq
            if r.emits and s.constraint is not None and not s.finalized:
                masks[i] = s.constraint.mask(s.constraint_state)
        return masks or None

    def history(self, launch: Launch) -> History | None:
        """The used tokens of rows with penalties (prompt, output so far), as of now: in the
        pipelined loop the previous step is committed by now, so nothing is missing."""
        used = {i: (r.seq.prompt_ids, r.seq.output_ids) for i, r in enumerate(launch.rows)
                if r.emits and not r.seq.finalized and r.seq.params.penalized}
        return used or None

    def finish_sampling(self, launch: Launch) -> None:
        """Masks, sample, start the device-to-host copy of the launch's tokens."""
        t0 = time.perf_counter()
        drafts = self.drafts(launch) if launch.plan.verify is not None else None
        self.device.launch_sample(launch.slot, launch.plan, self.allowed(launch),
                                  self.history(launch), drafts=drafts)
        self.device.launch_copy(launch.slot)
        launch.sampled = True
        self._span("sample", launch, t0)

    def commit(self, launch: Launch, tokens: list[int]) -> None:
        """Apply a step's tokens to its sequences; zombie rows are skipped and counted.

        A launch is committed exactly once, whatever raises inside it. A row whose work raises
        (a constraint's `advance`, the detokenizer) ends its own request with
        `FinishReason.ERROR` and the error's one line; its batch-mates go on. Every row is
        applied before any `on_text` callback runs: a callback that raises leaves the step
        committed and every sequence consistent.
        """
        now = t0 = time.perf_counter()
        assert not launch.committed, f"step {launch.plan.step} committed twice"
        if len(tokens) != launch.plan.num_samples:
            raise RuntimeError(f"step {launch.plan.step}: {len(tokens)} tokens for "
                               f"{launch.plan.num_samples} sampled positions of "
                               f"{len(launch.rows)} rows (a stale or torn host buffer)")
        self.scheduler.step = launch.plan.step  # finish and release times are this commit's
        launch.committed = True  # from here on never again, whatever raises
        pieces: list[tuple[int, str]] = []
        done = 0
        at = 0  # each row's first sampled position: a verify row has 1 + len(draft)
        try:
            for i, row in enumerate(launch.rows):
                done += 1  # counted first: an interrupt inside a row leaves it applied
                n = 1 if row.draft is None else 1 + len(row.draft)
                at += n
                try:
                    if row.draft is None:
                        self._commit_row(row, tokens[at - 1], now, pieces,
                                         launch.logprobs[i] if launch.logprobs else None)
                    else:
                        self._commit_verify(row, tokens[at - n:at], now, pieces)
                except Exception as err:  # this request's own failure: it alone ends
                    self._fail(row.seq, err)
        finally:  # an interrupt between rows (never expected: decoders defer Ctrl-C)
            for row in launch.rows[done:]:
                self._drop_row(row)
        if self.extra_host_work_s:  # a labelled what-if, never a headline number
            while time.perf_counter() - t0 < self.extra_host_work_s:
                pass
        self._span("commit", launch, t0)
        if self.on_text is not None:
            for request_id, piece in pieces:
                self.on_text(request_id, piece)

    def _commit_row(self, row: Row, tok: int, now: float, pieces: list[tuple[int, str]],
                    logprobs: list[float] | None = None) -> None:
        """One row of a commit. The step's reference is dropped before anything can raise."""
        seq, sched, st = row.seq, self.scheduler, self.stats
        if row.emits:
            seq.pending -= 1
        if row.pad or not (row.emits or seq.finalized):
            # padding, or an earlier chunk of a prompt: nothing to append
            seq.inflight_refs -= 1
            if row.pad:
                st.padding_rows += 1
            else:
                st.silent_rows += 1
            sched.release_if_done(seq)
            return
        if not commit_row(seq, tok):  # a zombie: finished at an earlier commit
            st.zombie_rows += 1
            sched.release_if_done(seq)
            return
        self._emit(seq, tok, now, pieces, logprobs)
        sched.release_if_done(seq)

    def _commit_verify(self, row: Row, choices: list[int], now: float,
                       pieces: list[tuple[int, str]]) -> None:
        """A verify row: commit the longest prefix of the draft the target agrees with and the
        target's token after it, one token at a time (a stop inside the run cuts it), then
        roll the sequence's KV back to what it committed: pages that hold only rejected
        positions return now."""
        seq, sched, st = row.seq, self.scheduler, self.stats
        seq.pending -= 1
        seq.inflight_refs -= 1  # this step no longer references the sequence
        if seq.finalized:  # cancelled since it was planned: a zombie
            seq.zombie_rows += 1
            st.zombie_rows += 1
        else:
            run = accept_greedy(row.draft, choices)
            st.accepted_tokens += len(run) - 1
            for tok in run:
                seq.output_ids.append(tok)
                if self._emit(seq, tok, now, pieces, None):
                    break
        # the KV of the committed context but its newest token (the next row's input) stays
        sched.rollback(seq, min(seq.num_cached, seq.num_tokens - 1))
        sched.release_if_done(seq)

    def _emit(self, seq: Sequence, tok: int, now: float, pieces: list[tuple[int, str]],
              logprobs: list[float] | None) -> bool:
        """What follows appending a token: its time, logprobs and text; the stop conditions.
        True when it ends the sequence."""
        seq.token_times_s.append(now - seq.arrival_s)
        if seq.params.logprobs is not None:
            assert logprobs is not None, f"step {self.scheduler.step}: no logprobs came back"
            seq.logprobs.append(unpack_logprobs(logprobs, seq.params.logprobs))
        if seq.first_token_s is None:
            seq.first_token_s = now - seq.arrival_s
        reason = self._stop_reason(seq, tok)
        if seq.detok is not None:
            piece = seq.detok.push(tok) if tok != self.eos_id else ""
            if reason is not None:
                piece += seq.detok.flush()
            seq.text += piece
            if piece:
                pieces.append((seq.request_id, piece))
        if reason is not None:
            self.scheduler.finalize(seq, reason)
        return reason is not None

    def _fail(self, seq: Sequence, err: Exception) -> None:
        """End a request whose commit raised: the error's one line, its resources returned."""
        seq.error = f"{type(err).__name__}: {err}".splitlines()[0]
        if not seq.finalized:
            self.scheduler.finalize(seq, FinishReason.ERROR)
        self.scheduler.release_if_done(seq)

    def _drop_row(self, row: Row) -> None:
        """A row never applied (its step was discarded, or its commit interrupted): drop its
        reference; its live sequence ends as cancelled (its token is lost)."""
        seq = row.seq
        if row.emits:
            seq.pending -= 1
        seq.inflight_refs -= 1
        if not row.pad:
            self.scheduler.finalize(seq, FinishReason.CANCELLED)  # no-op if already final
        self.scheduler.release_if_done(seq)

    def settle(self, *launches: Launch | None) -> None:
        """Finish what a decode loop leaves in flight when an exception ends it (in order).

        Each launched, uncommitted step is sampled if it was not, waited for and committed, so
        that every sequence is as if the run had stopped between steps, and a later run goes
        on with the same tokens. A step that cannot be finished (the device failed, a second
        interrupt) is discarded: its references are dropped and its live sequences end as
        cancelled (the device is a step ahead of them). Never raises: the loop's own exception
        is the one the caller sees.
        """
        seen: set[int] = set()
        for launch in launches:
            if launch is None or id(launch) in seen or launch.committed:
                continue
            if not launch.launched:  # planned, never launched: recomputed later
                self.scheduler.unplan(launch.rows)
                continue
            seen.add(id(launch))
            try:
                if not launch.sampled:
                    self.finish_sampling(launch)
                self.commit(launch, self.wait_tokens(launch))
            except BaseException:  # noqa: B036 - a cleanup path; the caller's error propagates
                if not launch.committed:
                    self._discard(launch)

    def _discard(self, launch: Launch) -> None:
        """Drop an unfinishable step's references; its live sequences end as cancelled."""
        launch.committed = True  # never again
        for row in launch.rows:
            self._drop_row(row)

    def stuck(self) -> RuntimeError:
        """The error for a loop that finds requests but nothing it can launch or commit."""
        sched = self.scheduler
        held = [(s.request_id, s.inflight_refs) for s in sched.running if s.finalized]
        return RuntimeError(
            f"scheduler stuck: {len(sched.waiting)} waiting, {len(sched.running)} running, none "
            f"live and no step in flight; finished but unreleased (request, inflight_refs): "
            f"{held[:8]} (a step's references were never committed, or a request larger than "
            "the pool was not refused at submit)")

    def _stop_reason(self, seq: Sequence, tok: int) -> FinishReason | None:
        if seq.constraint is not None:
            seq.constraint_state = seq.constraint.advance(seq.constraint_state, tok)
            if seq.constraint.is_done(seq.constraint_state):
                return FinishReason.STOP
        if seq.params.ignore_eos:
            pass
        elif tok == self.eos_id:  # a constrained row samples EOS only once its answer parses
            return FinishReason.STOP
        elif tok in seq.params.stop_ids and seq.constraint is None:
            return FinishReason.STOP  # (a stop id never cuts a constrained answer short)
        if len(seq.output_ids) >= seq.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def between_steps(self) -> None:
        """Let a caller submit or cancel between steps (tests, streaming front ends).

        A Ctrl-C that arrived during the step (`labkit.decoders.run` defers it) is raised
        here, where no step is half-launched or half-committed.
        """
        if self.interrupt_pending:
            self.interrupt_pending = False
            raise KeyboardInterrupt
        if self.on_step is not None:
            self.on_step(self)

    def completion(self, request_id: int, index: int | None = None,
                   prompt: str | None = None, sample: int = 0) -> Completion:
        """The finished request's result."""
        s = self.seqs[request_id]
        assert s.finalized, f"request {request_id} has not finished"
        return Completion(request_id if index is None else index, prompt, list(s.prompt_ids),
                          list(s.output_ids), s.text, s.finish_reason.value,
                          s.first_token_s if s.first_token_s is not None else float("nan"),
                          list(s.token_times_s), s.error,
                          list(s.logprobs) if s.params.logprobs is not None else None, sample)

    def forget(self, request_id: int) -> None:
        """Drop a finished request's record (take its `completion` first), so that a
        long-lived engine, such as a notebook's, does not keep every request it ever ran."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise KeyError(f"forget: no request with id {request_id}")
        if not seq.released:
            raise RequestError(f"request {request_id} is still running (or its pages are still "
                               "in flight); forget it after the run")
        del self.seqs[request_id]

    def close(self) -> None:
        """Stop the device (the simulated accelerator's process, CUDA streams)."""
        self.device.close()

    def check_all_released(self) -> None:
        """Assert every page, row and adapter slot is back (after a run)."""
        sched = self.scheduler
        assert sched.idle(), f"{len(sched.running)} running, {len(sched.waiting)} waiting"
        a = sched.allocator
        assert a.num_free == a.num_blocks, f"{a.num_blocks - a.num_free} KV pages still held"
        assert all(a.refcount(p) == 0 for p in range(a.num_blocks)), "a KV page has owners"
        assert sched.rows.num_free == sched.rows.size, "device rows still held"
        assert sched.adapters.num_free == sched.adapters.size, "adapter slots still held"
        for name, proposer in self.proposers.items():
            proposer.release(set())
            assert proposer.pages_held() == 0, f"the {name} draft still holds KV pages"
