"""Parallel sampling: n answers to one prompt share its pages; the first write copies.

Every check is held against a reference: the same samples run as independent requests (sample
j's seed, no fork), which must give the same tokens; and against the pool's own books (which
pages are shared, by how many, and that a copy holds the source page's K and V)."""

import random

import pytest
import torch

import labkit
from labkit import decoders
from labkit.engine import Engine
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.sampling import SamplingParams
from labkit.scheduler import RequestError

CFG = ModelConfig.tiny()
MODEL = init_random(LlamaModel(CFG).eval(), seed=5)
BS = 8


def make_engine(device="inprocess", **kw) -> Engine:
    e = Engine(MODEL, None, kv_tokens=kw.pop("kv_tokens", 512), block_size=BS, max_seqs=8,
               device=device, **kw)
    e.eos_id = -1  # a random model: every answer runs to its length
    return e


def prompt_of(n_tokens: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, CFG.vocab_size) for _ in range(n_tokens)]


def reference(prompt, params, decoder="blocking"):
    """Each sample as an independent request (its own seed, its own prefill)."""
    engine = make_engine()
    try:
        ids = [engine.submit(prompt, params.sample(j)) for j in range(params.n)]
        decoders.run(engine, decoder)
        return [engine.seqs[i].output_ids for i in ids]
    finally:
        engine.close()


PARAMS = SamplingParams(n=4, temperature=1.0, max_new_tokens=7, seed=3)


def test_forks_share_every_prompt_page_then_copy_the_partial_one_on_first_write():
    engine = make_engine()
    prompt = prompt_of(13)  # 13 tokens, pages of 8: one full page and a partial one
    ids = engine.submit_samples(prompt, PARAMS)
    alloc = engine.scheduler.allocator
    decoders.run(engine, "blocking", max_steps=1)  # the prompt's one launch
    seqs = [engine.seqs[i] for i in ids]
    table = seqs[0].block_table
    assert len(table) == 2 and all(s.block_table == table for s in seqs)
    assert [alloc.refcount(p) for p in table] == [4, 4], "every prompt page, partial too"
    st = engine.stats
    assert st.prefill_tokens == 13, "the prompt is computed once, not 4 times"
    assert (st.prefill_tokens_saved, st.pages_saved, st.cow_copies) == (39, 6, 0)
    assert all(len(s.output_ids) == 1 for s in seqs), "each fork drew its first token"
    k_before = engine.device.runner.cache.k.clone()

    decoders.run(engine, "blocking", max_steps=1)  # the first decode writes position 13
    assert st.cow_copies == 3, "three writers copy the partial page; the last keeps it"
    full, partial = {s.block_table[0] for s in seqs}, {s.block_table[1] for s in seqs}
    assert full == {table[0]} and alloc.refcount(table[0]) == 4, "the full page stays shared"
    assert len(partial) == 4 and table[1] in partial
    assert all(alloc.refcount(p) == 1 for p in partial)
    # each copy holds the source page's K and V for the prompt's 5 tokens in it
    kv = engine.device.runner.cache
    pool_before = k_before.view(CFG.num_layers, -1, BS, *kv.k.shape[2:])
    pool_now = kv.k.view(CFG.num_layers, -1, BS, *kv.k.shape[2:])
    for p in partial:
        assert torch.equal(pool_now[:, p, :5], pool_before[:, table[1], :5]), f"page {p}"

    decoders.run(engine, "blocking")
    got = [engine.seqs[i].output_ids for i in ids]
    assert got == reference(prompt, PARAMS), "a fork's tokens are its seed's, shared or not"
    assert len({tuple(g) for g in got}) > 1, "the samples differ"
    engine.check_all_released()
    engine.close()


def test_a_prompt_of_whole_pages_shares_them_and_copies_nothing():
    engine = make_engine()
    prompt = prompt_of(16, seed=1)
    ids = engine.submit_samples(prompt, PARAMS)
    decoders.run(engine, "pipelined")
    assert engine.stats.cow_copies == 0 and engine.stats.pages_saved == 6
    assert [engine.seqs[i].output_ids for i in ids] == reference(prompt, PARAMS)
    engine.check_all_released()
    engine.close()


@pytest.mark.parametrize("device", ["inprocess", "process",
                                    pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("decoder", ["blocking", "pipelined"])
def test_random_forks_cancels_and_preemptions_keep_every_token(device, decoder):
    """Forks of several prompts under a small pool (preemptions), with a step budget that
    splits prompts into chunks, and cancels at random steps: every uncancelled answer equals
    its independent reference, no page is freed while a launched step references it, and
    every page comes back."""
    engine = make_engine(device, kv_tokens=96, max_step_tokens=24)
    rng = random.Random(7)
    work = []
    for i in range(5):
        p = SamplingParams(n=rng.choice([2, 3, 4]), temperature=rng.choice([0.0, 1.0]),
                           max_new_tokens=rng.randrange(3, 20), seed=i)
        work.append((prompt_of(rng.randrange(3, 30), seed=10 + i), p, rng.choice([None, 2, 5])))
    freed_in_use = []

    def on_free(page):
        for s in engine.seqs.values():
            if page in s.block_table and not s.released and s.inflight_refs:
                freed_in_use.append(page)
    engine.scheduler.allocator.on_free = on_free
    groups, cancelled = [], set()
    for prompt, p, _ in work:
        groups.append(engine.submit_samples(prompt, p))

    def on_step(eng):
        for (_, _, cancel_at), ids in zip(work, groups):
            if cancel_at is not None and eng.steps == cancel_at:
                victim = ids[rng.randrange(len(ids))]
                if eng.cancel(victim):
                    cancelled.add(victim)
    engine.on_step = on_step
    decoders.run(engine, decoder)
    engine.check_all_released()
    assert freed_in_use == []
    st = engine.stats  # the workload exercised what it is here for
    assert st.pages_saved and st.cow_copies and st.preemptions and cancelled, st
    for (prompt, p, _), ids in zip(work, groups):
        want = reference(prompt, p)
        for j, rid in enumerate(ids):
            got = engine.seqs[rid].output_ids
            if rid in cancelled:
                assert got == want[j][:len(got)], f"cancelled sample {j}: a prefix"
            else:
                assert got == want[j], f"sample {j} of {prompt[:3]}..."
    engine.close()


def test_a_fork_whose_prompt_owner_is_cancelled_prefills_itself():
    engine = make_engine(max_step_tokens=8)  # a 20-token prompt: three chunks
    prompt = prompt_of(20, seed=4)
    ids = engine.submit_samples(prompt, PARAMS)
    decoders.run(engine, "blocking", max_steps=1)  # the first chunk only
    assert engine.seqs[ids[1]].attached
    engine.cancel(ids[0])
    decoders.run(engine, "blocking")
    want = reference(prompt, PARAMS)
    assert [engine.seqs[i].output_ids for i in ids[1:]] == want[1:]
    engine.check_all_released()
    engine.close()


def test_generate_returns_n_answers_per_prompt_in_order():
    engine = make_engine()
    out = labkit.generate([prompt_of(9), prompt_of(11, 2)], SamplingParams(
        n=3, temperature=1.0, max_new_tokens=4), engine=engine)
    assert [(c.index, c.sample) for c in out] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1),
                                                   (1, 2)]
    assert engine.stats.pages_saved == 2 * 2 + 2 * 2  # each prompt: 2 forks x 2 pages
    engine.close()


def test_bad_n_and_bad_forks_are_refused():
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 128\]"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n must be an integer"):
        SamplingParams(n=2.0)
    engine = make_engine()
    with pytest.raises(RequestError, match="submit_samples"):
        engine.submit([5, 6, 7], SamplingParams(n=2))
    first = engine.submit([5, 6, 7])
    with pytest.raises(RequestError, match="same prompt"):
        engine.submit([5, 6, 8], fork_of=first)
    engine.close()


def test_sample_seeds_differ_and_sample_zero_keeps_the_request_seed():
    p = SamplingParams(n=5, seed=11)
    seeds = [p.sample(j).seed for j in range(5)]
    assert seeds[0] == 11 and len(set(seeds)) == 5
    assert all(p.sample(j).n == 1 for j in range(5))
