"""Speculative decoding: proposers, the acceptance rules, and verify rows in the engine.

Every check is held against a reference written here: plain decoding of the same requests
(greedy: the same tokens; sampled: the same distribution, by a chi-square test that the wrong
rules written below fail), a brute-force prompt lookup, the geometric sum, and the pool's own
books (pages held, pages named by the prefix cache)."""

import json
import math
import random

import numpy as np
import pytest
import torch

import labkit.runner
from labkit import decoders
from labkit.engine import Engine
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.paged_kv import blocks_needed
from labkit.sampling import SamplingParams, rejection_sample
from labkit.scheduler import RequestError
from labkit.speculative import (
    PromptLookup,
    accept_greedy,
    accept_sampled,
    expected_tokens,
    predicted_speedup,
    rollback,
)

CFG = ModelConfig.tiny()
MODEL = init_random(LlamaModel(CFG).eval(), seed=5)
OTHER = init_random(LlamaModel(CFG).eval(), seed=6)  # a draft that disagrees often
BS = 4  # small pages: a verify row's rejected positions often fill a page of their own


def make_engine(model=MODEL, drafts=None, **kw) -> Engine:
    kw = {"kv_tokens": 1024, "block_size": BS, "max_seqs": 8, **kw}
    e = Engine(model, None, drafts={"int4": MODEL, "int8": OTHER} if drafts is None else drafts,
               **kw)
    e.eos_id = -1  # a random model: every answer runs to its length
    return e


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    # a small alphabet: prompt lookup finds earlier n-grams to propose
    return [[rng.randrange(3, 40) for _ in range(n)] for n in lengths]


def run_all(prompts, params, decoder="blocking", engine=None, **kw):
    engine = engine or make_engine(**kw)
    try:
        ids = [engine.submit(p, params) for p in prompts]
        decoders.run(engine, decoder)
        engine.check_all_released()
        return [engine.seqs[i].output_ids for i in ids], engine.stats
    finally:
        engine.close()


# -- the formulas and rules, alone ------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("k", [0, 1, 4, 8])
def test_expected_tokens_is_the_geometric_sum(alpha, k):
    assert expected_tokens(alpha, k) == pytest.approx(sum(alpha ** i for i in range(k + 1)),
                                                      rel=1e-12)


def test_expected_tokens_matches_independent_acceptances():
    rng = np.random.default_rng(0)
    alpha, k, n = 0.7, 4, 200_000
    accepted_run = (rng.random((n, k)) < alpha).cumprod(1).sum(1)  # drafts kept before a miss
    measured = (accepted_run + 1).mean()  # plus the target's own token
    assert measured == pytest.approx(expected_tokens(alpha, k), rel=0.01)  # 1% >> its noise


def test_predicted_speedup_and_bad_input():
    # a free draft and a verify that costs one plain step: the speedup is the tokens per step
    assert predicted_speedup(0.5, 3, 0.0, 1.0, 1.0) == pytest.approx(expected_tokens(0.5, 3))
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens(1.5, 2)


def test_accepted_keeps_the_longest_matching_prefix_then_the_target_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 9]) == [5, 6, 7, 9], "all kept: the bonus token"
    assert accept_greedy([5, 6, 7], [5, 8, 7, 9]) == [5, 8], "a later match does not count"
    assert accept_greedy([5, 6, 7], [4, 6, 7, 9]) == [4], "the first rejected: the target's own"
    with pytest.raises(ValueError, match="choices"):
        accept_greedy([5, 6], [5, 6])  # off by one at the bonus position


def brute_lookup(ctx, k, max_n):
    """The reference: the longest tail n-gram, its latest earlier occurrence, what followed."""
    for n in range(min(max_n, len(ctx) - 1), 0, -1):
        tail = ctx[-n:]
        for i in range(len(ctx) - n - 1, -1, -1):
            if ctx[i:i + n] == tail:
                return ctx[i + n:i + n + k]
    return []


def test_prompt_lookup_matches_brute_force():
    rng = random.Random(1)
    lookup = PromptLookup(CFG.vocab_size, max_ngram=4)
    found = 0
    for _ in range(300):
        ctx = [rng.randrange(0, 6) for _ in range(rng.randrange(1, 30))]
        k = rng.randrange(1, 6)
        got = lookup.lookup(ctx, k)
        assert got == brute_lookup(ctx, k, 4), (ctx, k)
        found += bool(got)
    assert found > 100, "the check must see proposals, not only empty ones"
    assert lookup.lookup([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1], "the longest tail wins"
    assert lookup.lookup([7], 3) == []


# -- the sampled rule: the output distribution is the target's --------------------------------

def chi2_quantile(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile at normal z (3.09: p = 0.001), Wilson-Hilferty's approximation
    (within 1% for dof >= 3)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def wrong_accept_if_p_at_least_q(p, q, draft, u, gumbel):
    """A mistake: keep the draft token whenever p >= q, reject it otherwise (no coin)."""
    k = draft.shape[0]
    keep = p[:k].gather(1, draft[:, None])[:, 0] >= q.gather(1, draft[:, None])[:, 0]
    residual = (p[:k] - q).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:k])
    return torch.cat([torch.where(keep, draft, (residual.log() + gumbel[:k]).argmax(-1)),
                      (p[k].log() + gumbel[k]).argmax(-1, keepdim=True)])


def wrong_resample_from_p(p, q, draft, u, gumbel):
    """A mistake: on rejection, draw from p instead of max(0, p - q)."""
    k = draft.shape[0]
    keep = u * q.gather(1, draft[:, None])[:, 0] < p[:k].gather(1, draft[:, None])[:, 0]
    return torch.cat([torch.where(keep, draft, (p[:k].log() + gumbel[:k]).argmax(-1)),
                      (p[k].log() + gumbel[k]).argmax(-1, keepdim=True)])


def first_token_counts(rule, p, q, n, seed=0):
    """How often each token is the first committed one, over n seeded verify steps."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[1], dtype=torch.long)
    k = q.shape[0]
    for _ in range(n):
        draft = torch.multinomial(q, 1, generator=gen)[:, 0]  # d_j ~ q_j
        u = torch.rand(k, generator=gen).clamp(1e-7, 1 - 1e-7)
        gumbel = -torch.log(-torch.log(torch.rand(k + 1, p.shape[1], generator=gen)
                                       .clamp(1e-7, 1 - 1e-7)))
        choices = rule(p, q, draft, u, gumbel).tolist()
        counts[accept_greedy(draft.tolist(), choices)[0]] += 1
    return counts


def gof_chi2(counts, probs):
    """Pearson's goodness of fit of counts to probabilities."""
    n = counts.sum()
    expected = probs * n
    return float(((counts - expected) ** 2 / expected).sum())


P = torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])
Q = torch.tensor([[0.10, 0.15, 0.20, 0.25, 0.30]])  # the draft favours what p does not


def test_rejection_rule_gives_the_target_distribution():
    n = 4000
    stat = gof_chi2(first_token_counts(rejection_sample, P, Q, n), P[0])
    assert stat < chi2_quantile(4), f"chi2 {stat:.1f}: the first token is not distributed as p"


@pytest.mark.parametrize("wrong", [wrong_accept_if_p_at_least_q, wrong_resample_from_p])
def test_the_same_test_fails_a_wrong_rule(wrong):
    n = 4000
    stat = gof_chi2(first_token_counts(wrong, P, Q, n), P[0])
    assert stat > chi2_quantile(4), f"{wrong.__name__} passed the test (chi2 {stat:.1f})"


def test_rejection_rule_never_redraws_a_rejected_token():
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        p = torch.softmax(torch.randn(3, 7, generator=gen), -1)
        q = torch.softmax(torch.randn(2, 7, generator=gen), -1)
        draft = torch.multinomial(q, 1, generator=gen)[:, 0]
        u = torch.rand(2, generator=gen).clamp(1e-7, 1 - 1e-7)
        g = -torch.log(-torch.log(torch.rand(3, 7, generator=gen).clamp(1e-7, 1 - 1e-7)))
        out = rejection_sample(p, q, draft, u, g)
        for j in range(2):
            keep = bool(u[j] * q[j, draft[j]] < p[j, draft[j]])
            assert (out[j] == draft[j]) == keep, "a rejected draft token was drawn again"


def test_the_readable_rule_and_the_batched_rule_choose_the_same_tokens():
    """speculative.accept_sampled (one sequence, chapter 09's statement) and
    sampling.rejection_sample (batched, what the engine runs) are one rule: fed the same
    uniforms and the same Gumbel noise, they commit the same tokens."""
    gen = torch.Generator().manual_seed(11)
    for trial in range(300):
        k = 1 + trial % 4
        p = torch.softmax(torch.randn(k + 1, 7, generator=gen) * 2, -1)
        q = torch.softmax(torch.randn(k, 7, generator=gen) * 2, -1)
        draft = torch.multinomial(q, 1, generator=gen)[:, 0]
        u = torch.rand(k, generator=gen).clamp(1e-6, 1 - 1e-6)
        g = -torch.log(-torch.log(torch.rand(k + 1, 7, generator=gen).clamp(1e-7, 1 - 1e-7)))
        batched = rejection_sample(p, q, draft, u, g).tolist()
        n = next((j for j in range(k) if batched[j] != draft[j]), k)
        assert readable_choice(draft.tolist(), q, p, u, g) == batched[:n + 1], trial


def readable_choice(draft, q, p, u, g):
    """accept_sampled fed the uniforms u in order and, for its one draw, the Gumbel noise of
    the position where it stopped (a rejected draft's, or the bonus position's)."""
    k, used = len(draft), []

    def uniform():
        used.append(float(u[len(used)]))
        return used[-1]

    def sample(dist):
        last = len(used) - 1
        rejected = used[-1] >= min(1.0, float(p[last, draft[last]] / q[last, draft[last]]))
        return int((dist.log() + g[last if rejected else k]).argmax())

    return accept_sampled(draft, q, p, uniform, sample)


def test_the_schedulers_rollback_keeps_the_pages_the_readable_rollback_keeps(monkeypatch):
    """Scheduler.rollback (the engine's) and speculative.rollback (chapter 09's statement)
    keep the same pages and free the same ones, for every verify row of a run."""
    from labkit.scheduler import Scheduler
    engine = make_engine()
    calls = []
    real = Scheduler.rollback

    def checked(self, seq, num_cached):
        before = list(seq.block_table)
        real(self, seq, num_cached)
        # num_cached valid entries: the committed token before the chunk and the accepted
        valid, keep, free = rollback(num_cached - 1, 0, before, BS)
        assert valid == num_cached and keep == seq.block_table and keep + free == before
        calls.append(len(free))

    monkeypatch.setattr(Scheduler, "rollback", checked)
    run_all(prompts_of([6, 9]), SamplingParams(max_new_tokens=30, speculative="int8:7"),
            engine=engine)
    assert calls and any(calls), "no verify row returned a page: nothing was compared"


# -- the engine: greedy exactness, rollback, the prefix cache, batching ----------------------

@pytest.mark.parametrize("spec", ["ngram:1", "ngram:3", "int4:2", "int4:8", "int8:1", "int8:5"])
def test_greedy_tokens_are_plain_decodings(spec):
    prompts = prompts_of([5, 13, 20, 9])
    plain, _ = run_all(prompts, SamplingParams(max_new_tokens=24))
    out, st = run_all(prompts, SamplingParams(max_new_tokens=24, speculative=spec))
    assert out == plain
    assert st.verify_rows > 0 and st.draft_tokens > 0, "no verify row ran"
    if spec.startswith("int4"):  # the draft is the model itself: every draft is accepted
        assert st.accepted_tokens == st.draft_tokens
    if spec.startswith("int8"):  # another model: rejections happened and were rolled back
        assert st.accepted_tokens < st.draft_tokens and st.draft_pages_returned > 0


def test_rollback_returns_pages_of_rejected_positions():
    engine = make_engine()
    prompt = prompts_of([6])[0]
    rid = engine.submit(prompt, SamplingParams(max_new_tokens=40, speculative="int8:7"))
    seq = engine.seqs[rid]
    alloc = engine.scheduler.allocator
    returned = 0
    while not seq.finalized:
        before = engine.stats.draft_pages_returned
        decoders.run(engine, "blocking", max_steps=1)
        # after every commit the table holds exactly the committed KV, nothing rejected
        assert seq.finalized or len(seq.block_table) == blocks_needed(seq.num_cached, BS)
        assert seq.finalized or seq.num_cached == seq.num_tokens - 1
        assert alloc.num_used == len(seq.block_table) or seq.finalized
        returned += engine.stats.draft_pages_returned - before
    assert returned > 0, "k = 7 on pages of 4 with a disagreeing draft must return pages"
    engine.check_all_released()


def test_prefix_cache_names_only_accepted_tokens():
    engine = make_engine(kv_tokens=2048)
    prompts = prompts_of([9, 17])
    params = SamplingParams(max_new_tokens=20, speculative="int8:4")
    ids = [engine.submit(p, params) for p in prompts]
    decoders.run(engine, "blocking")
    contexts = [engine.seqs[i].context for i in ids]
    # a second round whose prompts are the whole first contexts: their pages are looked up
    more = [engine.submit(c, params) for c in contexts]
    decoders.run(engine, "blocking")
    prefix = engine.scheduler.prefix
    for page, (_, tokens, _) in prefix._name_of.items():  # every named page's tokens are
        assert any(tuple(c[i:i + BS]) == tokens  # committed context at a page boundary
                   for c in contexts + [engine.seqs[i].context for i in more]
                   for i in range(0, len(c) - BS + 1, BS)), f"page {page} names {tokens}"
    plain, _ = run_all(contexts, SamplingParams(max_new_tokens=20))
    assert [engine.seqs[i].output_ids for i in more] == plain
    engine.check_all_released()


def test_verify_rows_run_beside_decode_rows_and_prefill_chunks():
    engine = make_engine(max_step_tokens=16)
    plans = []
    launch = engine.device.launch_forward
    engine.device.launch_forward = lambda slot, plan: (plans.append(plan), launch(slot, plan))
    prompts = prompts_of([6, 8, 40, 30], seed=3)
    spec = SamplingParams(max_new_tokens=20, speculative="int4:5")
    plain = SamplingParams(max_new_tokens=20)
    ids = [engine.submit(prompts[0], spec), engine.submit(prompts[1], plain)]
    engine.on_step = lambda e: ([e.submit(p, spec if i else plain)
                                 for i, p in enumerate(prompts[2:])]
                                if e.steps == 3 else None)
    decoders.run(engine, "blocking")
    ids += [2, 3]
    got = [engine.seqs[i].output_ids for i in ids]
    engine.check_all_released()
    mixed = [p for p in plans if p.verify is not None and any(v == 1 and q == 1 for v, q in zip(
        p.verify, p.query_lens)) and any(q > 1 and v == 1 for v, q in zip(p.verify,
                                                                          p.query_lens))]
    assert mixed, "no launch held a verify row, a decode row and a prefill chunk together"
    assert max(p.num_tokens for p in plans) <= 16, "a launch went over the token budget"
    ref, _ = run_all(prompts, plain)
    assert got == ref


def test_stop_inside_the_accepted_run_cuts_it():
    prompt = prompts_of([8])[0]
    plain, _ = run_all([prompt], SamplingParams(max_new_tokens=30))
    stop = plain[0][9]  # a token the answer reaches mid-way
    cut = plain[0][:plain[0].index(stop) + 1]
    for spec in (None, "int4:6", "ngram:4"):
        out, _ = run_all([prompt], SamplingParams(max_new_tokens=30, stop_ids=(stop,),
                                                  speculative=spec))
        assert out[0] == cut, spec
    out, _ = run_all([prompt], SamplingParams(max_new_tokens=7, speculative="int4:6"))
    assert out[0] == plain[0][:7], "max_new_tokens caps the accepted run"


# -- sampled requests through the engine ------------------------------------------------------

V16 = ModelConfig.tiny(vocab_size=16)
SMALL = init_random(LlamaModel(V16).eval(), seed=5)
SMALL_DRAFT = init_random(LlamaModel(V16).eval(), seed=6)
with torch.no_grad():  # sharper distributions than the random init's near-uniform ones
    for m in (SMALL, SMALL_DRAFT):
        m.embed.weight.mul_(2.5)


def token_histograms(spec, n=4000):
    """Counts of each output position's token (1..3: decided by verify rows) over n seeds."""
    engine = Engine(SMALL, None, kv_tokens=8192, block_size=8, max_seqs=64,
                    max_step_tokens=1024, drafts={"int4": SMALL_DRAFT})
    engine.eos_id = -1
    ids = [engine.submit([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=1.0, seed=s,
                                                   speculative=spec)) for s in range(n)]
    decoders.run(engine, "blocking")
    engine.check_all_released()
    out = np.array([engine.seqs[i].output_ids for i in ids])
    return np.stack([np.bincount(out[:, j], minlength=16) for j in (1, 2, 3)]), engine.stats


def two_sample_chi2(a, b):
    """Chi-square statistic and degrees of freedom: do a and b count the same distribution?"""
    stat, dof = 0.0, 0
    for x, y in zip(a, b):
        seen = (x + y) > 0
        x, y = x[seen].astype(float), y[seen].astype(float)
        n, m = x.sum(), y.sum()
        stat += float((((x / n - y / m) ** 2) / (x + y)).sum() * n * m)
        dof += int(seen.sum()) - 1
    return stat, dof


@pytest.fixture(scope="module")
def plain_histogram():
    return token_histograms(None)[0]


def test_sampled_speculation_keeps_the_target_distribution(plain_histogram):
    spec, st = token_histograms("int4:3")
    assert 0 < st.accepted_tokens < st.draft_tokens, "the test needs rejections"
    stat, dof = two_sample_chi2(plain_histogram, spec)
    assert stat < chi2_quantile(dof), f"chi2 {stat:.1f} over {dof} dof"


@pytest.mark.parametrize("wrong", [wrong_accept_if_p_at_least_q, wrong_resample_from_p])
def test_the_engine_test_fails_a_wrong_rule(plain_histogram, monkeypatch, wrong):
    monkeypatch.setattr(labkit.runner, "rejection_sample", wrong)
    spec, _ = token_histograms("int4:3")
    stat, dof = two_sample_chi2(plain_histogram, spec)
    assert stat > chi2_quantile(dof), f"{wrong.__name__} passed (chi2 {stat:.1f}, {dof} dof)"


def test_sampled_ngram_runs_with_its_one_hot_draft():
    prompts = prompts_of([12, 20])
    params = SamplingParams(max_new_tokens=16, temperature=0.8, seed=4, speculative="ngram:3")
    out, st = run_all(prompts, params)
    assert [len(o) for o in out] == [16, 16] and st.verify_rows > 0


# -- refusals ---------------------------------------------------------------------------------

def test_bad_speculative_settings_are_refused():
    for bad in ("int4", "int4:0", "int4:17", "fp16:2", "ngram:x", 4):
        with pytest.raises(ValueError, match="speculative must be"):
            SamplingParams(speculative=bad)
    engine = make_engine(drafts={})
    with pytest.raises(RequestError, match="needs an int4 draft model"):
        engine.submit([1, 2], SamplingParams(speculative="int4:2"))
    for kw, what in (({"presence_penalty": 0.5}, "penalties"), ({"logprobs": 2}, "logprobs")):
        with pytest.raises(RequestError, match=what):
            engine.submit([1, 2], SamplingParams(speculative="ngram:2", **kw))
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(MODEL, None, drafts={"int4": init_random(LlamaModel(ModelConfig.tiny(64)))})


def test_pipelined_decoder_refuses_speculation():
    engine = make_engine()
    engine.submit([1, 2, 3], SamplingParams(speculative="ngram:2"))
    with pytest.raises(RequestError, match="blocking decoder"):
        decoders.run(engine, "pipelined")
    decoders.run(engine, "blocking")  # the refusal changed nothing: it runs where it can
    engine.check_all_released()


def test_process_device_refuses_speculation():
    engine = make_engine(device="process")
    try:
        with pytest.raises(RequestError, match="in-process device"):
            engine.submit([1, 2, 3], SamplingParams(speculative="ngram:2"))
    finally:
        engine.close()


# -- SmolLM2: every example prompt, both proposers, k = 1..8 ----------------------------------

def example_prompts(tok):
    lines = [json.loads(s) for s in open("examples/requests.jsonl") if s.strip()]
    return [tok.encode(r["prompt"], chat=bool(r.get("chat"))) for r in lines]


def test_smollm2_greedy_is_exact_for_every_example_both_proposers_every_k(smollm2):
    from labkit.loading import load_model

    model, tok = smollm2
    draft, _ = load_model("smollm2-135m", quant="int4")
    prompts = example_prompts(tok)
    engine = Engine(model, tok, kv_tokens=16384, block_size=16, max_seqs=64,
                    max_step_tokens=1024, drafts={"int4": draft})
    n_new = 10
    try:
        plain = [engine.submit(p, SamplingParams(max_new_tokens=n_new)) for p in prompts]
        decoders.run(engine, "blocking")
        ref = [engine.seqs[i].output_ids for i in plain]
        for proposer in ("int4", "ngram"):  # the 8 prompts at every k in one run
            ids = {(i, k): engine.submit(p, SamplingParams(max_new_tokens=n_new,
                                                           speculative=f"{proposer}:{k}"))
                   for k in range(1, 9) for i, p in enumerate(prompts)}
            before = engine.stats.accepted_tokens
            decoders.run(engine, "blocking")
            for (i, k), rid in ids.items():
                assert engine.seqs[rid].output_ids == ref[i], (proposer, k, i)
            if proposer == "int4":
                assert engine.stats.accepted_tokens > before, "the int4 draft never agreed"
        engine.check_all_released()
    finally:
        engine.close()


# -- the command line -------------------------------------------------------------------------

def generate_json(capsys, *args):
    from labkit.cli import generate_main

    code = generate_main(["--model", "tiny", "--json", "--max-new-tokens", "12", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return [json.loads(line)["output_ids"] for line in captured.out.splitlines()]


def test_generate_speculative_flag_gives_the_plain_tokens(capsys):
    prompts = ("the cat sat on the mat and the cat sat", "one two three one two")
    plain = generate_json(capsys, *prompts)
    for spec in ("ngram:3", "int4:2"):
        assert generate_json(capsys, "--speculative", spec, *prompts) == plain, spec


def test_generate_refuses_bad_speculative_settings(capsys):
    from labkit.cli import generate_main

    assert generate_main(["--model", "tiny", "--speculative", "int4", "hi"]) == 2
    assert "--speculative: speculative must be" in capsys.readouterr().err
    assert generate_main(["--model", "tiny", "--decoder", "pipelined", "--speculative",
                          "ngram:2", "hi"]) == 2
    assert "blocking decoder" in capsys.readouterr().err


def test_parallel_samples_speculate_on_their_shared_prompt():
    """n answers share the prompt's pages; each one's first verify row copies the shared
    partial page before writing it (copy-on-write), and greedy answers stay the plain ones."""
    prompt = prompts_of([13])[0]  # pages of 4: the last one partial, shared by all three
    engine = make_engine()
    ids = engine.submit_samples(prompt, SamplingParams(n=3, max_new_tokens=12,
                                                       speculative="int4:3"))
    decoders.run(engine, "blocking")
    engine.check_all_released()
    plain, _ = run_all([prompt], SamplingParams(max_new_tokens=12))
    assert [engine.seqs[i].output_ids for i in ids] == plain * 3
    assert engine.stats.cow_copies >= 2 and engine.stats.verify_rows > 0


def test_server_flag_speculates_where_it_can_with_the_same_answers():
    pytest.importorskip("uvicorn")
    from labkit.loading import load_model
    from labkit.serving.server import create_app
    from tests.test_server_api import ThreadServer, post

    model, tok = load_model("tiny")
    answers = {}
    for spec in (None, "ngram:3"):
        engine = Engine(model, tok, kv_tokens=1024)
        server = ThreadServer(create_app(engine, "tiny", "blocking", None, spec))
        try:
            body = {"prompt": "one two three one two three one", "max_tokens": 12,
                    "temperature": 0, "ignore_eos": True}
            status, out = post(server, "/v1/completions", body)
            assert status == 200, out
            # a request with penalties cannot speculate: it runs plainly, not refused
            status, _ = post(server, "/v1/completions", {**body, "presence_penalty": 0.5})
            assert status == 200
            answers[spec] = (out["choices"][0]["text"], engine.stats.verify_rows)
        finally:
            server.close()
            engine.close()
    assert answers["ngram:3"][0] == answers[None][0]
    assert answers["ngram:3"][1] > 0 and answers[None][1] == 0, answers


def test_serve_refuses_speculation_on_the_pipelined_decoder(capsys):
    from labkit.serving.server import serve_main

    with pytest.raises(SystemExit) as exit_:
        serve_main(["--model", "tiny", "--speculative", "ngram:2"])  # decoder: pipelined
    assert exit_.value.code == 2 and "--decoder blocking" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_main(["--model", "tiny", "--decoder", "blocking", "--speculative", "ngram"])
    assert "--speculative: speculative must be" in capsys.readouterr().err


def test_bench_generate_speculative_flag(capsys):
    from labkit.bench.generate import main, run_labkit
    from labkit.loading import load_model

    model, tok = load_model("tiny")
    engine = Engine(model, tok, kv_tokens=1024, drafts={"int4": model})
    work = [(tok.encode("one two three one two three"), 10), (tok.encode("a b a b a b"), 6)]
    _, _, plain = run_labkit(engine, work)
    for spec in ("ngram:3", "int4:2"):
        _, n, outs = run_labkit(engine, work, speculative=spec)
        assert outs == plain and n == 16, spec
    engine.close()
    for argv, said in ((["--speculative", "ngram"], "--speculative: speculative must be"),
                       (["--speculative", "ngram:2", "--decoder", "pipelined"],
                        "--decoder blocking")):
        with pytest.raises(SystemExit):
            main(argv)
        assert said in capsys.readouterr().err


# ---- the draft's head: its top candidates rescored with the target's rows --------------------


def _int4_copy(model):
    import copy

    from labkit.quant import quantize_model

    return quantize_model(copy.deepcopy(model), "int4")


def test_reranked_head_rescores_only_the_top_candidates_with_the_given_rows(monkeypatch):
    from labkit.speculative import RerankedHead

    draft = _int4_copy(MODEL)
    x = torch.randn(3, CFG.hidden_size, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(draft, "hidden", lambda *a, **k: x)  # the draft's final-normed states
    own = draft.head(x)  # [3, V]: the draft's quantized head
    exact = x @ MODEL.embed.weight.t()  # the target's (tied) head on the same states
    wrapped = RerankedHead(draft, MODEL.embed.weight, rerank=8)
    got = wrapped(None, None, None)
    top = own.topk(8, dim=-1).indices
    mask = torch.zeros_like(own, dtype=torch.bool).scatter_(-1, top, True)
    assert torch.equal(got[~mask], own[~mask])  # the rest: the draft's own logits, untouched
    torch.testing.assert_close(got[mask], exact[mask])  # the top 8: the target's rows
    assert not torch.allclose(own[mask], exact[mask])  # (so the rescoring changed something)
    # logit_rows picks rows before the head, as the model's own forward does
    picked = wrapped(None, None, None, logit_rows=torch.tensor([2, 0]))
    torch.testing.assert_close(picked, got[[2, 0]])
    with pytest.raises(ValueError, match="do not match"):
        RerankedHead(draft, MODEL.embed.weight[:, :8])


def test_exact_head_is_the_plain_rows_or_none():
    from labkit.speculative import exact_head

    draft = _int4_copy(MODEL)
    assert exact_head(MODEL, draft) is MODEL.embed.weight  # tied: the embedding is the head
    assert exact_head(draft, MODEL) is None  # a quantized head has no plain rows
    wider = init_random(LlamaModel(ModelConfig.tiny(vocab_size=CFG.vocab_size * 2)).eval())
    assert exact_head(MODEL, wider) is None  # rows of another shape do not serve


def test_a_rescored_int4_draft_is_accepted_more_with_the_same_tokens():
    # a draft's head quantized to 4 bits picks other tokens than the model's; rescoring its
    # top candidates with the model's rows gives back most of them: counted, not timed
    draft = _int4_copy(MODEL)
    prompts = prompts_of([5, 9, 14, 7])
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, speculative="int4:4")
    plain, _ = run_all(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    accepted = {}
    for rerank in (0, 16):
        out, st = run_all(prompts, params, drafts={"int4": draft}, draft_rerank=rerank)
        assert out == plain, f"rerank {rerank}: speculation changed a greedy token"
        accepted[rerank] = st.accepted_tokens / st.draft_tokens
    assert accepted[16] > accepted[0], accepted


def test_engine_refuses_a_bad_draft_rerank():
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="draft_rerank"):
            make_engine(draft_rerank=bad)


def test_bench_spec_reports_the_draft_rerank_and_refuses_a_negative_one():
    import subprocess
    import sys

    def bench(*extra):
        return subprocess.run([sys.executable, "-m", "labkit", "bench", "spec", "--model", "tiny",
                               "--proposers", "int4,ngram", "--k", "2", "--gen-tokens", "8",
                               "--rounds", "1", "--json", *extra],
                              capture_output=True, text=True, timeout=300)

    proc = bench("--draft-rerank", "4")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["proposer"], r["draft_rerank"]) for r in rows] == [("int4", 4), ("ngram", 0)]
    assert all(r["same_tokens"] for r in rows)
    proc = bench("--draft-rerank", "-1")
    assert proc.returncode != 0 and "--draft-rerank must be >= 0" in proc.stderr
