"""Penalties and log-probabilities: against a plain reference, batch-invariant, on every device
and both decoders, and end to end against the model run without a KV cache."""

import math
import random

import pytest
import torch

from labkit import decoders
from labkit.engine import Engine
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.perplexity import CausalAttention
from labkit.sampling import (
    MAX_LOGPROBS,
    Penalties,
    SamplingBatch,
    SamplingParams,
    sample,
    token_logprobs,
    unpack_logprobs,
)

CFG = ModelConfig.tiny()
MODEL = init_random(LlamaModel(CFG).eval(), seed=3)
V = 64


def reference_penalize(row: list[float], prompt: list[int], output: list[int],
                       p: SamplingParams) -> list[float]:
    """One row, token by token, as the definitions read (Hugging Face's repetition penalty,
    then OpenAI's frequency and presence penalties on the output's counts)."""
    out = list(row)
    for tok in set(prompt) | set(output):
        x = out[tok]
        out[tok] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for tok in set(output):
        out[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    return out


def random_case(rng: random.Random, rows: int):
    params, history = [], {}
    for r in range(rows):
        if rng.random() < 0.25:
            params.append(SamplingParams())  # no penalty: must be left alone
            continue
        params.append(SamplingParams(
            presence_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
            frequency_penalty=rng.choice([0.0, 0.3, 1.7, -0.4]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.8, 2.0])))
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 20))]
        history[r] = (prompt, output)
    return params, history


@pytest.mark.parametrize("seed", range(6))
def test_penalties_match_the_reference_row_by_row(seed):
    rng = random.Random(seed)
    params, history = random_case(rng, 7)
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(seed)) * 3
    pen = Penalties.build(history, params, V, torch.device("cpu"))
    got = pen.apply(logits) if pen is not None else logits
    for r in range(7):
        if r in history and params[r].penalized:
            want = reference_penalize(logits[r].tolist(), *history[r], params[r])
        else:
            want = logits[r].tolist()
        assert got[r].tolist() == pytest.approx(want, abs=1e-5), f"row {r}"
    # the input is not changed in place (a CUDA graph's logits buffer is reused)
    assert pen is None or not torch.equal(got, logits)


def test_penalties_are_batch_invariant():
    rng = random.Random(7)
    params, history = random_case(rng, 8)
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, seed=i, presence_penalty=p.presence_penalty,
                             frequency_penalty=p.frequency_penalty,
                             repetition_penalty=p.repetition_penalty)
              for i, p in enumerate(params)]
    counters = list(range(8))
    together = sample(logits, SamplingBatch.build(params, counters, V),
                      penalties=Penalties.build(history, params, V, torch.device("cpu")))
    for r in range(8):
        alone_hist = {0: history[r]} if r in history else None
        alone = sample(logits[r:r + 1], SamplingBatch.build([params[r]], [r], V),
                       penalties=Penalties.build(alone_hist, [params[r]], V,
                                                 torch.device("cpu")))
        assert int(alone[0]) == int(together[r]), f"row {r}"


def test_a_strong_frequency_penalty_moves_greedy_off_a_repeated_token():
    logits = torch.zeros(1, V)
    logits[0, 5] = 1.0  # greedy picks 5
    p = SamplingParams(frequency_penalty=0.6)
    pen = Penalties.build({0: ([1], [5, 5])}, [p], V, torch.device("cpu"))
    # 5 was used twice: 1 - 2 * 0.6 < 0, so a fresh token (logit 0) now wins
    assert int(sample(logits, SamplingBatch.build([p], [2], V), penalties=pen)[0]) != 5
    assert int(sample(logits, SamplingBatch.build([SamplingParams()], [2], V))[0]) == 5


@pytest.mark.parametrize("kwargs,message", [
    ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
    ({"frequency_penalty": float("nan")}, r"frequency_penalty must be a number in \[-2, 2\]"),
    ({"frequency_penalty": True}, r"frequency_penalty must be a number"),
    ({"repetition_penalty": 0}, r"repetition_penalty must be a number in \(0, 100\]"),
    ({"repetition_penalty": float("inf")}, r"repetition_penalty must be a number in"),
    ({"logprobs": -1}, r"logprobs must be None or an integer in \[0, 20\]"),
    ({"logprobs": MAX_LOGPROBS + 1}, r"logprobs must be None or an integer in \[0, 20\]"),
    ({"logprobs": 1.0}, r"logprobs must be None or an integer"),
])
def test_bad_penalties_and_logprobs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_token_logprobs_match_log_softmax():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2)) * 4
    tokens = torch.tensor([0, 17, 63])
    packed = token_logprobs(logits, tokens, 5)
    ref = torch.log_softmax(logits.double(), -1)
    for r in range(3):
        lp, top = unpack_logprobs(packed[r].tolist(), 5)
        assert lp == pytest.approx(float(ref[r, tokens[r]]), abs=1e-5)
        want = ref[r].topk(5)
        assert [i for i, _ in top] == want.indices.tolist()
        assert [x for _, x in top] == pytest.approx(want.values.tolist(), abs=1e-5)
        # a request's own k is cut from the batch's widest
        assert unpack_logprobs(packed[r].tolist(), 2)[1] == top[:2]


# ---------------------------------------------------------------------------------------------
# end to end: every device, both decoders, against the model run without a cache

DEVICES = ["inprocess", "process", pytest.param("cuda", marks=pytest.mark.cuda)]
_ENGINES: dict[str, Engine] = {}


@pytest.fixture(scope="module", autouse=True)
def _close():
    yield
    for e in _ENGINES.values():
        e.close()
    _ENGINES.clear()


def engine_on(device: str) -> Engine:
    if device not in _ENGINES:
        _ENGINES[device] = Engine(MODEL, None, kv_tokens=512, block_size=8, max_seqs=6,
                                  device=device)
        _ENGINES[device].eos_id = -1  # a random model: run every request to its length
    return _ENGINES[device]


def requests():
    rng = random.Random(11)
    out = []
    for i in range(6):
        prompt = [rng.randrange(3, CFG.vocab_size) for _ in range(rng.randrange(2, 30))]
        params = SamplingParams(
            max_new_tokens=rng.randrange(4, 16), temperature=rng.choice([0.0, 0.9]), seed=i,
            presence_penalty=rng.choice([0.0, 1.5]), frequency_penalty=rng.choice([0.0, 0.8]),
            repetition_penalty=rng.choice([1.0, 1.5]),
            logprobs=rng.choice([None, 0, 3, MAX_LOGPROBS]))
        out.append((prompt, params))
    return out


def run_all(engine: Engine, decoder: str):
    ids = [engine.submit(p, params) for p, params in requests()]
    decoders.run(engine, decoder)
    out = [engine.completion(i) for i in ids]
    for i in ids:
        engine.forget(i)
    engine.check_all_released()
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_decoders_agree_on_tokens_and_logprobs(device):
    engine = engine_on(device)
    blocking, pipelined = run_all(engine, "blocking"), run_all(engine, "pipelined")
    for b, p in zip(blocking, pipelined):
        assert b.output_ids == p.output_ids
        # the same tokens; a row's logits may differ in the last bits between the loops'
        # batches (the fp32 matmuls are not batch-invariant), so the logprobs are close
        assert (b.logprobs is None) == (p.logprobs is None)
        for (blp, btop), (plp, ptop) in zip(b.logprobs or [], p.logprobs or []):
            assert blp == pytest.approx(plp, abs=1e-4)
            assert [x for _, x in btop] == pytest.approx([x for _, x in ptop], abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_and_logprobs_follow_the_cacheless_model(device):
    """Each greedy token is the argmax of the reference-penalized logits of the model run on
    the whole context; each logprob is log_softmax of those unpenalized logits."""
    engine = engine_on(device)
    for (prompt, params), c in zip(requests(), run_all(engine, "pipelined")):
        assert len(c.output_ids) == params.max_new_tokens
        for j, tok in enumerate(c.output_ids):
            ctx = torch.tensor(prompt + c.output_ids[:j])
            with torch.no_grad():
                logits = MODEL(ctx, torch.arange(len(ctx)), CausalAttention())[-1].double()
            if params.greedy:
                pen = reference_penalize(logits.tolist(), prompt, c.output_ids[:j], params)
                # the engine's attention sums in another order: a near-tie may go either way
                assert pen[tok] >= max(pen) - 1e-4, f"step {j}: {tok} is not the argmax"
            if params.logprobs is None:
                assert c.logprobs is None
                continue
            ref = torch.log_softmax(logits, -1)
            lp, top = c.logprobs[j]
            assert math.isclose(lp, float(ref[tok]), abs_tol=1e-4)
            assert len(top) == params.logprobs
            want = ref.topk(params.logprobs).values.tolist()
            assert [x for _, x in top] == pytest.approx(want, abs=1e-4)
            assert all(math.isclose(x, float(ref[i]), abs_tol=1e-4) for i, x in top)
