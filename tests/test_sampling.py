"""Sampling: validation, greedy, filters, exact distribution, and batch invariance."""

import pytest
import torch

from labkit.sampling import SamplingBatch, SamplingParams, sample, top_k_filter, top_p_filter


@pytest.mark.parametrize("kwargs,message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": 0}, "top_k must be None or an integer >= 1"),
    ({"seed": -1}, "seed must be in"),
    # regressions: settings that passed here and then broke on the device
    ({"temperature": float("inf")}, "not a finite float32"),
    ({"temperature": 1e39}, "not a finite float32"),  # finite in float64, inf in float32
    ({"temperature": 1e-40}, "below 1e-06"),  # logits / 1e-40 overflow to inf
    ({"top_p": 1e-46}, "rounds to 0 in float32"),  # emitted token 0 forever
    ({"seed": 1.5}, "seed must be in .* and an integer"),
    ({"seed": True}, "seed must be in .* and an integer"),  # JSON true is not a number
    ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
    ({"temperature": True}, "temperature must be >= 0"),
    ({"top_k": 2.0}, "top_k must be None or an integer"),
    ({"stop_ids": (3, 1.5)}, "stop_ids must be token ids"),
])
def test_bad_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def _batch(params, counters, vocab):
    return SamplingBatch.build(params, counters, vocab)


def test_greedy_is_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    toks = sample(logits, _batch([SamplingParams()] * 4, [0] * 4, 50))
    assert torch.equal(toks, logits.argmax(-1))


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 4.0, 3.0, 2.0]])
    out = top_k_filter(logits, torch.tensor([2, 1]))
    assert torch.isfinite(out).tolist() == [[False, True, True, False], [True, False, False, False]]


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = top_p_filter(probs.log(), torch.tensor([0.75]))
    # 0.5 < 0.75 so the second token is needed; 0.8 >= 0.75 so the third is not
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]


def test_samples_follow_softmax():
    """Gumbel-max with hashed noise draws from softmax(logits / T): a chi-square check."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 4000
    logits = (probs.log() * 0.7)[None].expand(n, 4)  # temperature 0.7 undoes the 0.7 scale
    params = [SamplingParams(temperature=0.7, seed=123)] * n
    toks = sample(logits, _batch(params, list(range(n)), 4))  # one draw per counter value
    counts = torch.bincount(toks, minlength=4).float()
    chi2 = (((counts - n * probs) ** 2) / (n * probs)).sum()
    assert chi2 < 16.27, f"chi-square {chi2:.1f} (3 dof, p=0.001 threshold 16.27): {counts}"


def test_a_request_samples_the_same_tokens_in_any_batch():
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(1, 300, generator=gen)
    mine = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    alone = sample(row, _batch([mine], [11], 300))
    others = torch.randn(7, 300, generator=gen)
    batch = torch.cat([others[:3], row, others[3:]])
    params = [SamplingParams(temperature=0.5, seed=i) for i in range(3)] + [mine] + [
        SamplingParams() for _ in range(4)]
    together = sample(batch, _batch(params, [0, 5, 9, 11, 2, 2, 2, 2], 300))
    assert together[3] == alone[0]


def test_seed_and_counter_change_the_draw():
    logits = torch.zeros(1, 1000)  # uniform: every token equally likely
    draws = {int(sample(logits, _batch([SamplingParams(temperature=1.0, seed=s)], [c], 1000)))
             for s in range(4) for c in range(4)}
    assert len(draws) > 12  # 16 draws from 1000 tokens: collisions are rare


def test_mask_is_respected_by_greedy_and_sampled_rows():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))
    allowed = torch.zeros(2, 20, dtype=torch.bool)
    allowed[:, [4, 9]] = True
    params = [SamplingParams(), SamplingParams(temperature=2.0, seed=1)]
    for c in range(20):
        toks = sample(logits, _batch(params, [c, c], 20), allowed)
        assert set(toks.tolist()) <= {4, 9}


def _reference_noise(seed, counter, vocab_size):
    """The hash in plain unsigned arithmetic on int64 (products stay below 2**63)."""
    m = 0xFFFFFFFF

    def mix(x):
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & m
        x = x ^ (x >> 15)
        x = (x * 0x2C1B3C6D) & m
        return x ^ (x >> 16)
    key = mix(mix((seed & m) ^ 0x243F6A88) ^ ((seed >> 32) & m))
    key = mix(key ^ mix(((counter & m) + 0x6A09E667) & m))
    vocab = torch.arange(vocab_size, dtype=torch.long)
    h = mix((key[:, None] + vocab[None, :] * 0x9E3779B1) & m)
    return ((h >> 9).float() + 0.5) / float(1 << 23)


def test_int32_noise_is_bit_for_bit_the_unsigned_hash():
    """The noise runs in int32 (wrapping multiplies, masked shifts) for speed; it must be the
    same 32-bit hash, or a torch build that did not wrap would change every sampled token."""
    from labkit.sampling import uniform_noise
    g = torch.Generator().manual_seed(3)
    seed = torch.cat([torch.tensor([0, 2**63 - 1, 2**32 - 1, 2**31]),
                      torch.randint(0, 2**63 - 1, (12,), generator=g)])
    counter = torch.cat([torch.tensor([0, 2**32 - 1, 2**31, 1]),
                         torch.randint(0, 2**40, (12,), generator=g)])
    assert torch.equal(uniform_noise(seed, counter, 5000), _reference_noise(seed, counter, 5000))


def test_rows_without_a_cut_are_untouched_by_the_filters():
    """top_p = 1 keeps every token even where a float cumsum rounds past 1, so a row samples
    the same whether or not a batch-mate cuts (the filters run only if some row does)."""
    logits = torch.randn(2, 3000, generator=torch.Generator().manual_seed(4)) * 8
    kept = top_p_filter(logits, torch.tensor([1.0, 0.5]))
    assert torch.equal(kept[0], logits[0])
    assert torch.isinf(kept[1]).any()
    mine = SamplingParams(temperature=1.0, seed=7)
    alone = sample(logits[:1], _batch([mine], [3], 3000))
    beside = sample(logits, _batch([mine, SamplingParams(temperature=1.0, top_p=0.5,
                                                          top_k=10)], [3, 3], 3000))
    assert alone.item() == beside[0].item()


def test_top_k_above_the_vocabulary_is_no_cut_beside_a_real_cut():
    """Regression: top_k > V crashed any batch that also had a real top-k cut (the crash
    depended on the batch-mates)."""
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(2, vocab)
    big = SamplingParams(temperature=1.0, top_k=vocab + 10, seed=3)
    none = SamplingParams(temperature=1.0, seed=3)
    cut = SamplingParams(temperature=1.0, top_k=5, seed=4)
    mixed = sample(logits, _batch([big, cut], [0, 0], vocab))
    plain = sample(logits, _batch([none, cut], [0, 0], vocab))
    assert mixed.tolist() == plain.tolist()  # top_k > V keeps every token


def test_numpy_integers_are_accepted_as_integers():
    import numpy as np
    p = SamplingParams(seed=np.int64(7), top_k=np.int32(3), max_new_tokens=np.int64(2))
    assert (p.seed, p.top_k, p.max_new_tokens) == (7, 3, 2)
    assert type(p.seed) is int


def test_every_draw_lies_strictly_inside_0_1():
    """Every hash value, not a sample of them: each of the 2^23 codes the draw keeps, with the
    discarded low bits all 0 and all 1, and the hash's extremes. The Gumbel noise of each is
    finite (a draw of exactly 1.0 made it +inf, and a filtered token's -inf + inf a NaN)."""
    from labkit.sampling import _as_int32, hash_to_unit

    codes = torch.arange(1 << 23, dtype=torch.long) << 9
    extremes = torch.tensor([0, 1, 0x1FF, 2**31 - 1, 2**31, 2**32 - 1, 2**32 - 512])
    for h in (codes, codes | 0x1FF, extremes):
        u = hash_to_unit(_as_int32(h))
        assert u.dtype == torch.float32
        assert bool((u > 0).all()) and bool((u < 1).all()), (
            f"a draw outside (0, 1): {u[(u <= 0) | (u >= 1)][:4].tolist()}")
        assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())


def test_top_k_1_is_greedy_for_every_seed():
    """top_k = 1 leaves one finite logit per row, so every seed must return the argmax: on a
    SmolLM2-sized vocabulary, about one row in 340 drew a 1.0 somewhere with 24-bit draws."""
    vocab = 49152
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1.0, top_k=1, seed=s) for s in range(256)]
    for counter in range(4):
        for row in range(4):
            batch = _batch(params, [counter] * len(params), vocab)
            toks = sample(logits[row].expand(len(params), vocab), batch)
            wrong = (toks != logits[row].argmax()).nonzero().flatten().tolist()
            assert not wrong, (f"top_k=1 sampled a filtered token for seeds {wrong[:5]} at "
                               f"counter {counter}: a -inf logit plus +inf noise")


def test_a_masked_token_is_never_sampled():
    """A constraint mask leaves two tokens; whatever the seed, the draw is one of them."""
    vocab = 49152
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(6)).expand(256, vocab)
    allowed = torch.zeros(256, vocab, dtype=torch.bool)
    allowed[:, [17, 40000]] = True
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(256)]
    for counter in range(6):
        toks = sample(logits, _batch(params, [counter] * 256, vocab), allowed)
        assert set(toks.tolist()) <= {17, 40000}, f"a masked token was sampled at {counter}"


def test_an_all_greedy_step_needs_no_settings_and_a_sampled_one_says_so():
    # the runner packs no settings where every row is greedy (known on the host)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, None, all_greedy=True), logits.argmax(-1))
    with pytest.raises(ValueError, match="batch of settings"):
        sample(logits, None, all_greedy=False)
