"""The engine on the real SmolLM2: transformers' greedy tokens, batching, caches, streaming.

The reference is transformers' own model read from the same GGUF file (its dequantization and
Q/K un-permutation, not labkit's; see `labkit.bench.generate.hf_reference_model`), run one
prompt at a time, unpadded, greedy. labkit runs the prompts together, as a serving engine does.
"""

import pytest
import torch

import labkit
from labkit import Engine, RequestError, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
# (text, chat): chat prompts get SmolLM2's template (a system turn: ~30 tokens); the plain ones
# are long enough on their own. The second is answered in a few words, so it ends on EOS.
PROMPTS = [
    ("In two or three sentences, explain why the sky looks blue during the day but red at "
     "sunset.", True),
    ("Answer with one word only: what is the opposite of hot?", True),
    ("The history of the printing press begins in the fifteenth century, when Johannes "
     "Gutenberg, a goldsmith from Mainz, combined several existing technologies into a single "
     "machine that", False),
    ('def fibonacci(n):\n    """Return the n-th Fibonacci number, computed iteratively so that '
     'it runs in linear time and constant memory."""\n', False),
]
# eight requests of mixed lengths for the batching tests: the four above plus four short ones
BATCH_TEXTS = [t for t, _ in PROMPTS] + ["Hello!", "Once upon a time", "2 + 2 =",
                                         "My favourite colour is"]


def mixed_params(n: int, new_tokens: int = 12) -> list[SamplingParams]:
    """Greedy on even rows; seeded temperature / top-k / top-p sampling on odd rows."""
    return [SamplingParams(max_new_tokens=new_tokens) if i % 2 == 0 else
            SamplingParams(max_new_tokens=new_tokens, temperature=0.9, top_k=50, top_p=0.9,
                           seed=1000 + i) for i in range(n)]


@pytest.fixture(scope="module")
def hf():
    """transformers' SmolLM2 from the packaged GGUF, fp32 (converted once, then cached)."""
    from labkit.bench.generate import hf_reference_model

    return hf_reference_model()


@pytest.fixture(scope="module")
def engine(smollm2):
    model, tok = smollm2
    return Engine(model, tok, kv_tokens=8192 + 256, max_seqs=16)


@torch.inference_mode()
def hf_greedy(hf, ids: list[int], new_tokens: int, eos: int) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt (ends with EOS if it stops)."""
    x = torch.tensor([ids])
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                      do_sample=False, pad_token_id=eos, eos_token_id=eos)
    return out[0, len(ids):].tolist()


def test_greedy_matches_transformers_generate(smollm2, hf, engine):
    model, tok = smollm2
    ids = [tok.encode(text, chat=chat) for text, chat in PROMPTS]
    assert min(map(len, ids)) >= 32, [len(i) for i in ids]
    outs = labkit.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS), engine=engine)
    engine.check_all_released()
    for i, (o, p) in enumerate(zip(outs, ids)):
        want = hf_greedy(hf, p, NEW_TOKENS, tok.eos_id)
        assert o.output_ids == want, (
            f"prompt {i} ({len(p)} tokens): labkit and transformers part at token "
            f"{next(j for j, (a, b) in enumerate(zip(o.output_ids + [-1], want + [-1])) if a != b)}"
            f"\nlabkit:       {o.output_ids}\ntransformers: {want}")
        assert o.finish_reason == ("stop" if want[-1] == tok.eos_id else "length")
    # the one-word answer ends on EOS, which labkit keeps in output_ids (and not in the text)
    assert outs[1].output_ids[-1] == tok.eos_id and outs[1].finish_reason == "stop"
    assert outs[1].text == tok.decode(outs[1].output_ids)


def test_alone_or_in_a_batch_of_8_gives_the_same_tokens(engine):
    params = mixed_params(len(BATCH_TEXTS))
    together = labkit.generate(BATCH_TEXTS, params, engine=engine)
    for i in (0, 1, 3, 6):  # greedy and sampled, long and short prompts
        alone = labkit.generate(BATCH_TEXTS[i], params[i], engine=engine)
        assert alone[0].output_ids == together[i].output_ids, (
            f"request {i} ({'greedy' if params[i].greedy else 'sampled'}): alone gave "
            f"{alone[0].output_ids}, in a batch of 8 {together[i].output_ids}")
    engine.check_all_released()


def test_paged_and_contiguous_caches_give_the_same_tokens(smollm2):
    model, tok = smollm2
    params = mixed_params(len(BATCH_TEXTS))
    outs = {}
    for cache in ("paged", "contiguous"):
        # contiguous: 2048 slots cut into 8 rows of 256 tokens, enough for every request here
        e = Engine(model, tok, cache=cache, kv_tokens=2048, max_seqs=8)
        outs[cache] = [o.output_ids for o in labkit.generate(BATCH_TEXTS, params, engine=e)]
        e.check_all_released()
    assert outs["paged"] == outs["contiguous"]


def test_streamed_pieces_concatenate_to_the_text(engine):
    pieces: dict[int, list[str]] = {}
    params = mixed_params(len(BATCH_TEXTS), new_tokens=20)
    outs = labkit.generate(BATCH_TEXTS, params, engine=engine,
                           on_text=lambda i, text: pieces.setdefault(i, []).append(text))
    for o in outs:
        assert "".join(pieces.get(o.index, [])) == o.text, f"request {o.index}"
        assert o.text == engine.tokenizer.decode(o.output_ids)
    assert max(len(p) for p in pieces.values()) > 5, "text arrived in one piece: not streamed"
    assert engine.on_text is None  # generate() removes its callback afterwards


@pytest.mark.parametrize("prompt,make_params,error,match", [
    ("", lambda: SamplingParams(), RequestError, "empty"),
    ("  \n", lambda: SamplingParams(), RequestError, "empty"),
    ("word " * 8200, lambda: SamplingParams(), RequestError, "context of 8192 tokens"),
    ("Hi", lambda: SamplingParams(max_new_tokens=0), ValueError, "max_new_tokens"),
    ("Hi", lambda: SamplingParams(temperature=-0.5), ValueError, "temperature"),
    ("Hi", lambda: SamplingParams(top_p=0.0), ValueError, "top_p"),
    ("Hi", lambda: SamplingParams(top_p=1.5), ValueError, "top_p"),
], ids=["empty", "blank", "too-long", "max-new-0", "temperature-neg", "top-p-0", "top-p-1.5"])
def test_bad_input_is_refused_and_the_engine_stays_clean(engine, prompt, make_params, error,
                                                         match):
    with pytest.raises(error, match=match):
        # SamplingParams validate themselves, so bad settings fail before reaching the engine
        labkit.generate(["A good prompt, queued first.", prompt],
                        [SamplingParams(max_new_tokens=4), make_params()], engine=engine)
    engine.check_all_released()  # nothing half-queued: the good request was not submitted
    assert not engine.scheduler.waiting
    ok = labkit.generate("Hi", SamplingParams(max_new_tokens=2), engine=engine)
    assert len(ok[0].output_ids) == 2  # and the engine still works
    engine.check_all_released()


@pytest.mark.parametrize("decoder", ["blocking", "pipelined"])
def test_top_k_1_and_a_choice_hold_for_every_seed_on_smollm2(engine, decoder):
    """The review's reproducers, and every seed around them: top_k = 1 answers as greedy does
    ("The capital of France is" with seed 75 answered " lactose"), and a yes/no choice answers
    yes or no (seed 63 emitted " veniles"): a filtered or masked token is never sampled."""
    prompt = "The capital of France is"
    greedy = labkit.generate(prompt, SamplingParams(max_new_tokens=3), engine=engine,
                             decoder=decoder)[0].output_ids
    seeds = range(96)
    outs = labkit.generate([prompt] * len(seeds), [
        SamplingParams(max_new_tokens=3, temperature=1.0, top_k=1, seed=s) for s in seeds],
        engine=engine, decoder=decoder)
    wrong = [(s, o.text) for s, o in zip(seeds, outs) if o.output_ids != greedy]
    assert not wrong, f"top_k=1 differed from greedy {greedy}: (seed, text) {wrong[:4]}"
    question = "Is Paris in France? Answer yes or no."
    outs = labkit.generate([question] * len(seeds), [
        SamplingParams(max_new_tokens=4, temperature=1.0, seed=s) for s in seeds],
        engine=engine, decoder=decoder, chat=True,
        constraints=[{"choice": ["yes", "no"]}] * len(seeds))
    bad = [(s, o.text) for s, o in zip(seeds, outs) if o.text.strip() not in ("yes", "no")]
    assert not bad, f"a choice constraint emitted a masked token: (seed, text) {bad[:4]}"
