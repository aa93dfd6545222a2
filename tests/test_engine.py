"""The engine on a tiny random model: batching, caches, admission, cancels, bad input."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labkit import decoders
from labkit.engine import Engine
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.sampling import SamplingParams
from labkit.scheduler import RequestError

CFG = ModelConfig.tiny()
MODEL = init_random(LlamaModel(CFG).eval(), seed=0)


def engine(**kw) -> Engine:
    kw.setdefault("kv_tokens", 4096)
    kw.setdefault("block_size", 8)
    kw.setdefault("max_seqs", 16)
    return Engine(MODEL, None, **kw)


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, CFG.vocab_size) for _ in range(rng.randrange(1, 40))]
            for _ in range(n)]


def run(e, prompt_list, params_list):
    ids = [e.submit(p, sp) for p, sp in zip(prompt_list, params_list)]
    decoders.run(e)
    e.check_all_released()
    return [e.seqs[i].output_ids for i in ids]


def mixed_params(n):
    return [SamplingParams(max_new_tokens=3 + i % 7, temperature=0.9 * (i % 2), top_p=0.9,
                           seed=100 + i) for i in range(n)]


def reference_greedy(prompt, n):
    """Greedy decoding by re-running the whole sequence each token: no cache at all."""
    from tests.test_model_parity import labkit_logits  # no cache, whole sequence each time
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(labkit_logits(MODEL, [torch.tensor(ids)])[0][-1].argmax()))
    return ids[len(prompt):]


def test_greedy_matches_recomputing_without_cache():
    ps = prompts(3, seed=5)
    got = run(engine(), ps, [SamplingParams(max_new_tokens=6)] * 3)
    assert got == [reference_greedy(p, 6) for p in ps]


def test_paged_and_contiguous_caches_agree():
    ps, sp = prompts(6, seed=1), mixed_params(6)
    assert run(engine(cache="paged"), ps, sp) == run(engine(cache="contiguous"), ps, sp)


def test_alone_or_in_a_batch_of_8_gives_the_same_tokens():
    ps, sp = prompts(8, seed=2), mixed_params(8)
    together = run(engine(), ps, sp)
    for i in (0, 3, 5):  # greedy and sampled rows
        assert run(engine(), [ps[i]], [sp[i]]) == [together[i]]


def test_full_pool_makes_requests_wait_not_fail():
    # 4 pages of 8 tokens: each request reserves 2 pages, so at most 2 run at once
    e = engine(kv_tokens=32, block_size=8)
    ps = [[5] * 10 for _ in range(5)]
    out = run(e, ps, [SamplingParams(max_new_tokens=4)] * 5)
    assert all(len(o) == 4 for o in out)
    assert max(s.finished_at_step for s in e.seqs.values()) > min(
        s.finished_at_step for s in e.seqs.values())  # they ran in waves


def test_request_that_can_never_fit_is_refused_at_once():
    e = engine(kv_tokens=32, block_size=8)
    with pytest.raises(RequestError, match="whole pool has 4"):
        e.submit([1] * 30, SamplingParams(max_new_tokens=8))
    assert e.scheduler.idle()  # nothing half-queued


@pytest.mark.parametrize("prompt,message", [([], "empty prompt"),
                                            ([1] * CFG.max_position, "does not fit")])
def test_bad_prompts_are_refused(prompt, message):
    e = engine(kv_tokens=8192)
    with pytest.raises(RequestError, match=message):
        e.submit(prompt)
    assert e.scheduler.idle()


def test_cancel_unknown_request():
    with pytest.raises(KeyError, match="no request with id 42"):
        engine().cancel(42)


def test_cancel_waiting_and_running_frees_once():
    e = engine(kv_tokens=32, block_size=8)
    ids = [e.submit([7] * 10, SamplingParams(max_new_tokens=6)) for _ in range(4)]

    def on_step(eng):
        if eng.steps == 2:
            assert eng.cancel(ids[0])  # running
            assert eng.cancel(ids[3])  # still waiting
            assert not eng.cancel(ids[3])  # already cancelled: a no-op
    e.on_step = on_step
    decoders.run(e)
    e.check_all_released()
    assert [e.seqs[i].finish_reason.value for i in ids] == ["cancelled", "length", "length",
                                                            "cancelled"]
    assert e.seqs[ids[3]].output_ids == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 8), st.integers(0, 12),
                          st.booleans()), min_size=1, max_size=8),
       st.integers(2, 6))
def test_random_workloads_release_everything(requests, pool_pages):
    """Any mix of lengths, pool sizes, cancels: all pages back, none freed twice."""
    e = engine(kv_tokens=pool_pages * 8, block_size=8, max_seqs=3)
    freed = []
    e.scheduler.allocator.on_free = freed.append
    ids, cancel_at = [], {}
    for plen, new, when, cancel in requests:
        try:
            rid = e.submit([3] * plen, SamplingParams(max_new_tokens=new))
        except RequestError:
            assert -(-(plen + new) // 8) > pool_pages  # refused only if it can never fit
            continue
        ids.append(rid)
        if cancel:
            cancel_at.setdefault(when, []).append(rid)
    e.on_step = lambda eng: [eng.cancel(r) for r in cancel_at.get(eng.steps, [])]
    decoders.run(e)
    e.check_all_released()  # every page, row and adapter slot is back
    # pages come and go as sequences grow (a double free would raise); every one came back
    assert len(freed) >= len({p for r in ids for p in e.seqs[r].block_table})
    for rid in ids:
        s = e.seqs[rid]
        assert s.released and s.inflight_refs == 0
        assert len(s.output_ids) <= s.max_new_tokens


def test_a_step_writing_a_free_page_is_stopped_before_launch():
    e = engine(kv_tokens=64, block_size=8)
    rid = e.submit([5] * 3, SamplingParams(max_new_tokens=4))
    launch = e.plan_step()
    (seq,) = launch.seqs
    e.scheduler.allocator.free(seq.block_table)  # a bug elsewhere freed its pages
    with pytest.raises(RuntimeError, match=f"KV page {seq.block_table[0]} written while free"):
        e.launch(launch, slot=0)
    assert e.seqs[rid].inflight_refs == 0


def test_a_long_lived_engine_keeps_no_record_of_finished_generate_calls():
    import labkit
    e = engine()
    first = labkit.generate(prompts(3), SamplingParams(max_new_tokens=4), engine=e)
    again = labkit.generate(prompts(3), SamplingParams(max_new_tokens=4), engine=e)
    assert [c.output_ids for c in first] == [c.output_ids for c in again]  # same answers
    assert e.seqs == {}  # the completions hold everything; the engine forgot the requests
    assert e.cancel(0) is False  # a forgotten request is simply finished
    with pytest.raises(KeyError, match="no request with id 99"):
        e.cancel(99)


def test_forget_refuses_a_request_that_is_still_running():
    e = engine()
    rid = e.submit([5, 6, 7], SamplingParams(max_new_tokens=3))
    with pytest.raises(RequestError, match="still running"):
        e.forget(rid)
    decoders.run(e)
    e.forget(rid)
    with pytest.raises(KeyError, match="forget: no request"):
        e.forget(rid)
    e.check_all_released()


def test_clear_prefix_cache_makes_the_next_run_cold():
    SP = SamplingParams
    engine = Engine(MODEL, None, kv_tokens=512, block_size=8, max_seqs=4)
    prompt = list(range(3, 40))  # 37 tokens: 4 full pages to share
    for expect_saved in (0, 32):
        before = engine.stats.prefill_tokens_saved
        rid = engine.submit(prompt, SP(max_new_tokens=2))
        decoders.run(engine, "blocking")
        engine.forget(rid)
        assert engine.stats.prefill_tokens_saved - before == expect_saved
    assert engine.clear_prefix_cache() == 4
    before = engine.stats.prefill_tokens_saved
    engine.submit(prompt, SP(max_new_tokens=2))
    decoders.run(engine, "blocking")
    assert engine.stats.prefill_tokens_saved == before, "a cleared cache shares nothing"
    engine.check_all_released()
    engine.close()
