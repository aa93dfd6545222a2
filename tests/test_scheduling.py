"""The scheduler: mixed steps, chunked prefill, static batching, pages on demand, preemption,
prefix sharing. Every run is checked against a plain reference run (a large pool, whole
prefills, no sharing): the same tokens, and every page back in its pool."""

import random

import pytest

from labkit import decoders
from labkit.engine import Engine
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.paged_kv import KVPoolExhausted
from labkit.sampling import SamplingParams
from labkit.scheduler import RequestError

CFG = ModelConfig.tiny()
MODEL = init_random(LlamaModel(CFG).eval(), seed=3)
EOS = 2
DECODERS = ["blocking", "pipelined"]
BS = 8  # tokens per KV page in every engine here

_ENGINES: dict[tuple, Engine] = {}


def get_engine(device="inprocess", **kw) -> Engine:
    """One engine per (device, settings) for the module (a simulated device takes seconds)."""
    kw = {"kv_tokens": 4096, "max_seqs": 8, **kw}
    key = (device, tuple(sorted(kw.items())))
    if key not in _ENGINES:
        e = Engine(MODEL, None, block_size=BS, device=device, **kw)
        e.eos_id = EOS
        _ENGINES[key] = e
    e = _ENGINES[key]
    e.stats.reset()
    return e


REFERENCE = {"max_step_tokens": None, "prefix_caching": False}  # whole prefills, no sharing


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    for e in _ENGINES.values():
        e.close()
    _ENGINES.clear()


def instrument(engine: Engine) -> list[str]:
    """Watch the pool: a page written must be owned by the writer alone, a page that returns
    must not be held by a sequence a launched step references, allocation never fails."""
    alloc, problems = engine.scheduler.allocator, []
    check, allocate = type(alloc).check_writable, type(alloc).allocate

    def check_writable(pages, shared_ok=False):
        for p in pages:
            holders = [s.request_id for s in engine.scheduler.running if p in s.block_table]
            if not shared_ok and (alloc.refcount(p) != 1 or len(holders) != 1):
                problems.append(f"page {p} written with refcount {alloc.refcount(p)}, "
                                f"held by {holders}")
        check(alloc, pages, shared_ok)

    def on_free(page):
        for s in engine.seqs.values():
            if page in s.block_table and s.inflight_refs and not s.released:
                problems.append(f"page {page} freed while request {s.request_id} is in flight")

    def allocate_or_fail(n):
        try:
            return allocate(alloc, n)
        except KVPoolExhausted as err:  # the scheduler must check (and preempt) first
            problems.append(f"pool ran out mid-step: {err}")
            raise

    alloc.check_writable, alloc.on_free, alloc.allocate = check_writable, on_free, allocate_or_fail
    return problems


def uninstrument(engine: Engine) -> None:
    alloc = engine.scheduler.allocator
    for name in ("check_writable", "allocate"):
        alloc.__dict__.pop(name, None)
    alloc.on_free = None


def run_workload(engine: Engine, decoder: str, reqs, record=None):
    """Run requests (prompt, params, arrive_step, cancel_after) with arrivals and cancels
    between steps; returns [(output_ids, finish_reason)] and checks the pools afterwards."""
    ids: dict[int, int] = {}
    problems = instrument(engine)
    start = engine.steps

    def on_step(eng):
        now = eng.steps - start
        for i, (prompt, params, arrive, cancel) in enumerate(reqs):
            if i not in ids and (arrive <= now or eng.scheduler.idle()):
                ids[i] = eng.submit(prompt, params)
            if cancel is not None and i in ids and now == arrive + cancel:
                eng.cancel(ids[i])
        if record is not None:
            record(eng)
    engine.on_step = on_step
    try:
        decoders.run(engine, decoder)
    finally:
        engine.on_step = None
        uninstrument(engine)
    assert problems == []
    engine.check_all_released()
    out = [(engine.seqs[ids[i]].output_ids, engine.seqs[ids[i]].finish_reason.value)
           for i in range(len(reqs))]
    for rid in ids.values():
        engine.forget(rid)
    return out


def same_tokens(got, want):
    """Equal, except that a cancel (which lands between steps) may keep a longer or shorter
    prefix of the same tokens."""
    for i, ((g, gw), (w, ww)) in enumerate(zip(got, want)):
        if "cancelled" in (gw, ww):
            n = min(len(g), len(w))
            assert g[:n] == w[:n], f"request {i}: {g} vs {w}"
        else:
            assert (g, gw) == (w, ww), f"request {i}"


def workload(seed: int, n: int = 10, cancels: bool = True, shared: bool = True):
    """Random prompts (half start with one shared 2-page system prompt), greedy and sampled
    rows, random finish times (stop ids), arrivals over the first steps, some cancels."""
    rng = random.Random(seed)
    system = [rng.randrange(3, CFG.vocab_size) for _ in range(2 * BS)]
    reqs = []
    for _ in range(n):
        head = system if shared and rng.random() < 0.6 else []
        prompt = head + [rng.randrange(3, CFG.vocab_size) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(max_new_tokens=rng.randrange(1, 18),
                                temperature=rng.choice([0.0, 1.2]), seed=rng.randrange(1000),
                                stop_ids=tuple(rng.sample(range(3, CFG.vocab_size), 4)))
        cancel = rng.choice([None, None, None, 2, 5]) if cancels else None
        reqs.append((prompt, params, rng.choice([0, 0, 1, 3, 6]), cancel))
    return reqs


# -- mixed steps and chunked prefill -----------------------------------------------------------

@pytest.mark.parametrize("device", ["inprocess", "process"])
@pytest.mark.parametrize("decoder", DECODERS)
def test_chunked_mixed_steps_give_the_tokens_of_whole_prefills(device, decoder):
    reqs = workload(0, cancels=False, shared=False)
    want = run_workload(get_engine("inprocess", **REFERENCE), "blocking", reqs)
    e = get_engine(device, max_step_tokens=7, prefix_caching=False)  # 1 to 5 chunks
    got = run_workload(e, decoder, reqs)
    assert got == want
    st = e.stats
    assert st.silent_rows > 0, "no prompt was split: the test proves nothing"
    assert max(st.step_tokens) <= 7, f"a launch carried {max(st.step_tokens)} tokens > budget 7"
    assert st.prefill_tokens == sum(len(p) for p, *_ in reqs)


@pytest.mark.parametrize("decoder", DECODERS)
def test_every_running_sequence_gets_a_token_every_step_under_steady_arrivals(decoder):
    e = get_engine(max_step_tokens=16, prefix_caching=False)
    rng = random.Random(1)
    # one new request every step; each prompt needs 2-3 chunks beside the decode rows
    reqs = [([rng.randrange(3, CFG.vocab_size) for _ in range(20)],
             SamplingParams(max_new_tokens=6, ignore_eos=True), i, None) for i in range(12)]
    got: dict[int, list[int]] = {}

    def record(eng):  # between steps: which launch gave each sequence its tokens
        for s in eng.seqs.values():
            got.setdefault(s.request_id, [])
            while len(got[s.request_id]) < len(s.output_ids):
                got[s.request_id].append(eng.steps)
    run_workload(e, decoder, reqs, record)
    for rid, steps in got.items():
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        assert all(g == 1 for g in gaps), (
            f"request {rid} got its tokens after launches {steps}: a running sequence must "
            "get a token in every step (decode rows go first; arrivals never stall them)")
    assert e.stats.silent_rows > 0 and max(e.stats.step_tokens) <= 16


def test_a_prompt_longer_than_the_budget_emits_only_with_its_last_chunk():
    e = get_engine(max_step_tokens=4)
    rid = e.submit(list(range(3, 13)), SamplingParams(max_new_tokens=2, ignore_eos=True))
    lens = []
    e.on_step = lambda eng: lens.append(len(eng.seqs[rid].output_ids))
    decoders.run(e, "blocking")
    e.on_step = None
    assert e.stats.step_tokens == [4, 4, 2, 1]  # 10 prompt tokens in chunks of 4, 4, 2
    assert lens[:4] == [0, 0, 0, 1] and e.stats.silent_rows == 2
    e.forget(rid)


# -- static batching ---------------------------------------------------------------------------

@pytest.mark.parametrize("decoder", DECODERS)
def test_static_batching_gives_the_same_tokens_and_pads_finished_rows(decoder):
    reqs = [(p, sp, 0, None) for p, sp, _, _ in workload(2, n=7, cancels=False)]
    want = run_workload(get_engine(max_seqs=3), decoder, reqs)
    e = get_engine(max_seqs=3, batching="static")
    first_token, finished = {}, {}

    def record(eng):
        for s in eng.seqs.values():
            if s.output_ids:
                first_token.setdefault(s.request_id, eng.steps)
            if s.finalized:
                finished.setdefault(s.request_id, eng.steps)
    assert run_workload(e, decoder, reqs, record) == want
    assert e.stats.padding_rows > 0, "finished members must stay in the batch as padding"
    # batches of 3: nobody of a batch starts before everyone of the one before has finished
    ids = sorted(first_token)
    for k in range(3, len(ids), 3):
        assert min(first_token[i] for i in ids[k:k + 3]) >= max(finished[i] for i in ids[k - 3:k])


# -- pages on demand -----------------------------------------------------------------------------

def test_pages_on_demand_hold_less_than_reserving_the_maximum():
    reqs = [([5 + i] * 12, SamplingParams(max_new_tokens=200, seed=i,
                                          stop_ids=(7, 9, 11)), 0, 3) for i in range(4)]
    peak = {}
    for reserve in ("max", "on_demand"):
        e = get_engine(kv_tokens=2048, kv_reserve=reserve, prefix_caching=False)
        run_workload(e, "pipelined", reqs)
        peak[reserve] = e.stats.peak_pages_used
    # max: 4 x ceil(212 / 8) = 108 pages up front; on demand: what 3-4 steps wrote
    assert peak["max"] == 4 * 27 and peak["on_demand"] <= 4 * 3, peak


def test_contiguous_cache_reserves_a_row_and_agrees():
    reqs = workload(4, n=6, cancels=False, shared=False)
    want = run_workload(get_engine(**REFERENCE), "blocking", reqs)
    e = get_engine(kv_tokens=1024, max_seqs=4, cache="contiguous")
    assert run_workload(e, "pipelined", reqs) == want
    assert e.stats.peak_pages_used % (1024 // BS // 4) == 0  # whole rows: 32 pages each


# -- preemption ----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["inprocess", "process"])
@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_workloads_on_a_small_pool_give_the_large_pool_tokens(device, decoder, seed):
    """Preemption, cancels, prefix sharing and zombies at once."""
    reqs = workload(10 + seed)
    want = run_workload(get_engine("inprocess", **REFERENCE), decoder, reqs)
    # 6 pages of 8 tokens: the longest request (35 + 17 tokens) needs 7... so fewer tokens
    e = get_engine(device, kv_tokens=7 * BS, max_step_tokens=12)
    got = run_workload(e, decoder, reqs)
    same_tokens(got, want)
    assert e.stats.preemptions > 0, "the pool never ran out: the test proves nothing"
    assert e.stats.prefill_tokens_saved > 0 or seed == 1


def _two_requests(b_new: int):
    a = ([3 + i for i in range(BS)], SamplingParams(max_new_tokens=2 * BS, ignore_eos=True))
    b = ([40 + i for i in range(4)], SamplingParams(max_new_tokens=b_new, temperature=1.1,
                                                    seed=7, ignore_eos=True))
    return [(*a, 0, None), (*b, 0, None)]


def test_preempted_while_in_flight_and_as_it_finishes():
    """Pipelined: the latest arrival is preempted while its row is in flight; that row's token
    is committed (never a zombie, never twice), its pages return after, it is recomputed."""
    seen = {"in_flight": 0, "as_it_finishes": 0}
    for b_new in range(3, 14):
        reqs = _two_requests(b_new)
        want = run_workload(get_engine(**REFERENCE), "blocking", reqs)
        e = get_engine(kv_tokens=4 * BS, max_step_tokens=None)
        events = []
        preempt = e.scheduler.preempt

        def spy(seq, preempt=preempt, events=events):
            events.append((seq, seq.inflight_refs, len(seq.output_ids)))
            preempt(seq)
        e.scheduler.preempt = spy
        try:
            got = run_workload(e, "pipelined", reqs)
        finally:
            del e.scheduler.preempt
        assert got == want, f"b_new={b_new}"
        for seq, refs, n_out in events:
            seen["in_flight"] += refs > 0
            # its in-flight row was its last: it finished at that commit, never requeued
            seen["as_it_finishes"] += refs > 0 and n_out + 1 == seq.max_new_tokens
            assert seq.zombie_rows <= 1
    assert seen["in_flight"] and seen["as_it_finishes"], seen


@pytest.mark.parametrize("decoder", DECODERS)
def test_cancel_while_preempted(decoder):
    e = get_engine(kv_tokens=4 * BS, max_step_tokens=None)
    reqs = _two_requests(12)
    state = {}

    def record(eng):
        b = sorted(eng.seqs.items())[1][1] if len(eng.seqs) > 1 else None
        if b is not None and (b.preempted or (b.output_ids and b.row is None)) and not state:
            state["at"] = (b.preempted, b.status.value, len(b.output_ids))
            eng.cancel(b.request_id)
    got = run_workload(e, decoder, reqs, record)
    assert state, "request 1 was never preempted"
    assert got[1][1] == "cancelled" and got[0][1] == "length"
    want = run_workload(get_engine(**REFERENCE), decoder, reqs)
    same_tokens(got, want)


def test_request_that_can_never_fit_is_refused_and_a_full_pool_waits():
    e = get_engine(kv_tokens=4 * BS)
    with pytest.raises(RequestError, match="whole pool has 4"):
        e.submit([3] * 30, SamplingParams(max_new_tokens=3))
    reqs = [([3 + i] * 20, SamplingParams(max_new_tokens=10, ignore_eos=True), 0, None)
            for i in range(4)]  # 30 tokens each: one at a time fits, two do not
    out = run_workload(e, "pipelined", reqs)
    assert all(len(o) == 10 for o, _ in out)


# -- prefix sharing ------------------------------------------------------------------------------

@pytest.mark.parametrize("decoder", DECODERS)
def test_a_shared_system_prompt_is_prefilled_once(decoder):
    first = 200 + 50 * DECODERS.index(decoder)  # pages no earlier run has cached
    system = list(range(first, first + 3 * BS))  # 3 full pages
    reqs = [(system + [50 + i, 60 + i], SamplingParams(max_new_tokens=4), 0, None)
            for i in range(5)]
    want = run_workload(get_engine(**REFERENCE), decoder, reqs)
    e = get_engine()
    assert run_workload(e, decoder, reqs) == want
    assert e.stats.prefill_tokens_saved == 4 * len(system)
    assert e.stats.pages_saved == 4 * 3
    assert e.stats.prefill_tokens == len(system) + 5 * 2


def test_a_fully_cached_prompt_copies_its_last_page_before_writing():
    """Copy-on-write: the last token of a prompt that is entirely cached must be computed
    again (for its logits); its page is shared, so the sequence takes a private one."""
    prompt = list(range(100, 100 + 2 * BS))  # exactly 2 pages, seen by no earlier test
    e = get_engine()
    reqs = [(prompt, SamplingParams(max_new_tokens=3), 0, None),
            (prompt, SamplingParams(max_new_tokens=3), 1, None)]
    a, b = run_workload(e, "pipelined", reqs)  # instrumented: no shared page is written
    assert a == b
    assert e.stats.pages_saved == 1 and e.stats.prefill_tokens_saved == BS


def test_cached_prefix_pages_are_evicted_when_the_pool_needs_them():
    e = get_engine(kv_tokens=4 * BS)
    first = [([3 + i] * (2 * BS), SamplingParams(max_new_tokens=2), 0, None) for i in range(2)]
    run_workload(e, "blocking", first)
    assert len(e.scheduler.prefix) > 0  # their pages stay cached at refcount 0
    big = [(list(range(20, 20 + 3 * BS)), SamplingParams(max_new_tokens=6), 0, None)]
    assert len(run_workload(e, "blocking", big)[0][0]) == 6  # evicted to make room


# -- static batching with pages on demand (the capstone's own ablation) --------------------------

@pytest.mark.parametrize("device", ["inprocess", "process"])
@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_static_batches_on_a_small_pool_give_the_large_pool_tokens(device, decoder, seed):
    """The random-workload test of continuous batching, for static batches whose pages come
    on demand: a member that needs a page a finished member holds, or the batch's last live
    member preempted after padding rows are planned, must neither livelock nor crash."""
    from tests.deadline import deadline

    reqs = workload(20 + seed)
    want = run_workload(get_engine("inprocess", **REFERENCE), decoder, reqs)
    e = get_engine(device, kv_tokens=7 * BS, max_step_tokens=12, batching="static")
    with deadline(120, f"static batching on a small pool (seed {seed}, {decoder})"):
        got = run_workload(e, decoder, reqs)
    same_tokens(got, want)
    assert e.stats.padding_rows > 0, "no member finished before its batch: proves nothing"
    assert e.stats.steps < 2000, f"{e.stats.steps} steps for {len(reqs)} requests: padding spun"


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_static_member_waiting_for_a_finished_members_pages_still_runs(decoder):
    """Two members on a 4-page pool: A finishes holding 3 pages, B's prefill needs 2. B must
    still get its tokens (not thousands of padding-only steps)."""
    from tests.deadline import deadline

    a = ([3 + i for i in range(2 * BS)], SamplingParams(max_new_tokens=BS, ignore_eos=True))
    b = ([50 + i for i in range(2 * BS - 2)], SamplingParams(max_new_tokens=6, ignore_eos=True))
    want = run_workload(get_engine(**REFERENCE), decoder, [(*a, 0, None), (*b, 0, None)])
    e = get_engine(kv_tokens=4 * BS, max_step_tokens=BS, batching="static",
                   prefix_caching=False)
    with deadline(60, "a static member waiting for a finished member's pages"):
        got = run_workload(e, decoder, [(*a, 0, None), (*b, 0, None)])
    assert got == want and e.stats.steps < 200, e.stats.steps


# -- faults inside commit --------------------------------------------------------------------------

def _fault_at(engine: Engine, faults: dict[tuple, int]):
    """Make the commit of a request's k-th token raise (keyed by its prompt), as a constraint's
    `advance` or a detokenizer might; returns a checker that every step leaves refs >= 0."""
    real = engine._stop_reason
    seen_bad: list[str] = []

    def stop_reason(seq, tok):
        k = faults.get(tuple(seq.prompt_ids))
        if k is not None and len(seq.output_ids) == k:
            raise ValueError(f"injected fault at token {k}")
        return real(seq, tok)

    def check(eng):
        for s in eng.seqs.values():
            if s.inflight_refs < 0 or s.pending < 0:
                seen_bad.append(f"request {s.request_id}: refs {s.inflight_refs}, "
                                f"pending {s.pending}")
    engine._stop_reason = stop_reason
    return check, seen_bad


@pytest.mark.parametrize("device", ["inprocess", "process"])
@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_commit_that_raises_ends_only_its_own_request(device, decoder, seed):
    """Random workloads on a small pool (preemption, sharing, zombies) with faults injected into
    commit: the failing request ends "error" with the tokens committed before, every other
    request gets the reference's tokens, refs never go negative, every page returns, and the
    engine serves the next workload."""
    reqs = workload(30 + seed, cancels=False)
    want = run_workload(get_engine(**REFERENCE), "blocking", reqs)
    rng = random.Random(seed)
    faulty = rng.sample(range(len(reqs)), 4)
    faults = {tuple(reqs[i][0]): rng.randrange(1, 5) for i in faulty}
    e = get_engine(device, kv_tokens=7 * BS, max_step_tokens=12)
    check, bad = _fault_at(e, faults)
    try:
        got = run_workload(e, decoder, reqs, record=check)
    finally:
        del e._stop_reason
    assert bad == [], bad[:4]
    hit = 0
    for i, ((g, gw), (w, ww)) in enumerate(zip(got, want)):
        k = faults.get(tuple(reqs[i][0]))
        if k is not None and len(w) >= k:
            hit += 1
            assert (g, gw) == (w[:k], "error"), f"request {i} (fault at token {k})"
        else:
            assert (g, gw) == (w, ww), f"request {i}: a batch-mate of a failure changed"
    assert hit, "no fault fired: the test proves nothing"
    same_tokens(run_workload(e, decoder, reqs[:4]), want[:4])  # the engine serves on


@pytest.mark.parametrize("decoder", DECODERS)
def test_an_error_in_commit_is_one_line_on_the_completion(decoder):
    e = get_engine()
    prompt = [5, 6, 7, 8]
    check, _ = _fault_at(e, {tuple(prompt): 2})
    try:
        rid = e.submit(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
        decoders.run(e, decoder)
    finally:
        del e._stop_reason
    c = e.completion(rid)
    assert c.finish_reason == "error" and c.error == "ValueError: injected fault at token 2"
    assert len(c.output_ids) == 2
    e.forget(rid)
    e.check_all_released()


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_callback_that_raises_leaves_every_step_committed_once(decoder):
    """on_text raises mid-run: the error reaches the caller, no token is appended twice, refs
    never go negative, and after the leftovers are cancelled the engine serves again."""
    reqs = [(p, sp, 0, None) for p, sp, _, _ in workload(5, n=4, cancels=False)]
    want = run_workload(get_engine(**REFERENCE), "blocking", reqs)
    e = get_engine(kv_tokens=7 * BS, max_step_tokens=12)
    ids = [e.submit(p, sp) for p, sp, _, _ in reqs]
    calls = []

    def on_step(eng):
        for s in eng.seqs.values():
            assert s.inflight_refs >= 0 and s.pending >= 0
        calls.append(eng.steps)
        if len(calls) == 4:
            raise RuntimeError("a callback failed")
    e.on_step = on_step
    try:
        with pytest.raises(RuntimeError, match="a callback failed"):
            decoders.run(e, decoder)
    finally:
        e.on_step = None
    for rid, (w, _) in zip(ids, want):  # what was committed is a prefix, once
        got = e.seqs[rid].output_ids
        assert got == w[:len(got)], f"request {rid}: {got} is not a prefix of {w}"
        if not e.seqs[rid].finalized:
            e.cancel(rid)
    decoders.run(e, decoder)
    for rid in ids:
        e.forget(rid)
    e.check_all_released()
    same_tokens(run_workload(e, decoder, reqs), want)
