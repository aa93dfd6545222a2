"""labkit: a small, complete LLM inference engine, built one idea at a time.

    import labkit
    out = labkit.generate(["The capital of France is"], labkit.SamplingParams(max_new_tokens=8))
    print(out[0].text)
"""

from __future__ import annotations

from labkit.decoders import run
from labkit.engine import Completion, Engine
from labkit.sampling import SamplingParams
from labkit.scheduler import RequestError

__version__ = "0.1.0"
__all__ = ["Completion", "Engine", "RequestError", "SamplingParams", "generate", "get_engine",
           "run"]

_ENGINES: dict[tuple, Engine] = {}


def get_engine(model: str = "smollm2-135m", quant: str | None = None,
               drafts: tuple[str, ...] = (), **engine_kwargs) -> Engine:
    """A cached engine for a model name or path (loaded once per process); `quant`: a
    labkit.quant scheme name, or None for fp32 weights; `drafts`: quantized copies of the
    model for speculative decoding to draft with ("int4", "int8")."""
    drafts = tuple(sorted(drafts))
    key = (model, quant, drafts, tuple(sorted(engine_kwargs.items())))
    if key not in _ENGINES:
        from labkit.loading import load_model
        m, tok = load_model(model, quant=quant, fuse=True)  # q|k|v, gate|up: fewer calls
        copies = {name: load_model(model, quant=name)[0] for name in drafts}
        _ENGINES[key] = Engine(m, tok, drafts=copies, **engine_kwargs)
    return _ENGINES[key]


def generate(prompts, params: SamplingParams | list[SamplingParams] | None = None, *,
             model: str = "smollm2-135m", engine: Engine | None = None,
             decoder: str = "blocking", chat: bool = False, on_text=None,
             constraints=None) -> list[Completion]:
    """Generate for each prompt (text or token ids); results in input order.

    `params`: one SamplingParams for all, or one per prompt; with `n` > 1 a prompt gets n
    answers (parallel sampling: its prompt is computed once and its pages shared), listed
    after one another, `Completion.sample` 0..n-1. `on_text(index, text)` receives text as it
    is detokenized; `index` is the answer's position in the returned list. `constraints`:
    None, or one constraint spec per prompt (dicts as in `labkit.constraints.parse_constraint`,
    or None).
    """
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise RequestError("no prompts given")
    engine = engine or get_engine(model)
    params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(
        prompts)
    if len(params_list) != len(prompts):
        raise RequestError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
    specs = constraints or [None] * len(prompts)
    if len(specs) != len(prompts):
        raise RequestError(f"{len(specs)} constraints for {len(prompts)} prompts")
    # validate and encode everything before queueing anything: a bad request loses nothing
    encoded = []
    for i, (prompt, spec) in enumerate(zip(prompts, specs)):
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise RequestError("this engine has no tokenizer: pass token ids")
            if not prompt.strip():
                raise RequestError(f"prompt {i} is empty")
            ids = engine.tokenizer.encode(prompt, chat=chat)
        else:
            ids = list(prompt)
        if not ids:
            raise RequestError(f"prompt {i} is empty")
        constraint = None
        if spec is not None:
            from labkit.constraints_json import parse_constraint
            constraint = parse_constraint(spec, engine.vocab)
        # what submit will check, the constraint's raised cap included: nothing is queued
        # unless every request can run
        engine.check(ids, params_list[i] or SamplingParams(), constraint)
        encoded.append((ids, constraint))
    index_of: dict[int, int] = {}  # request id -> its position in the answer list
    answer_of: list[tuple[int, int]] = []  # position -> (prompt index, sample)
    for i, ((ids, constraint), p) in enumerate(zip(encoded, params_list)):
        for j, rid in enumerate(engine.submit_samples(ids, p or SamplingParams(),
                                                      constraint=constraint)):
            index_of[rid] = len(answer_of)
            answer_of.append((i, j))
    if on_text is not None:
        engine.on_text = lambda rid, text: on_text(index_of[rid], text) if rid in index_of \
            else None
    try:
        run(engine, decoder)
    except BaseException:  # Ctrl-C, a callback that raised: this call's requests go with it
        for rid in index_of:  # the loop settled its steps: nothing of ours is in flight
            engine.cancel(rid)
            if engine.seqs[rid].released:
                engine.forget(rid)
        raise
    finally:
        engine.on_text = None
    out = []
    for rid, k in index_of.items():
        i, j = answer_of[k]
        out.append(engine.completion(rid, i, prompts[i] if isinstance(prompts[i], str) else None,
                                     sample=j))
    for rid in index_of:  # the completions hold everything: the engine keeps no record
        engine.forget(rid)
    return out
