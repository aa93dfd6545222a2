"""The OpenAI API as labkit's server speaks it: what a request may say, what it becomes, and the
shapes of the answers.

A request's body is checked field by field (pydantic) and then turned into what the engine
takes: token ids and `SamplingParams`. Anything labkit cannot do is refused with a 400 that
names it, never silently ignored: an unknown field, a prompt that does not fit the context,
log-probabilities asked of a stream. The answers (a whole completion,
the chunks of a streamed one, an error object) are built here too, as the OpenAI API spells
them, so that a client written for OpenAI, vLLM or SGLang reads them unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from labkit.engine import Completion
from labkit.sampling import MAX_LOGPROBS, MAX_SAMPLES, SamplingParams
from labkit.scheduler import RequestError, Scheduler

MAX_STOP_STRINGS = 4  # as OpenAI's API

# ---------------------------------------------------------------------------------------------
# errors, as a client is told them


class BadRequest(ValueError):
    """A request the server refuses with a 400 (the message is shown to the client)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def one_line(err: BaseException) -> str:
    """`Type: the message's first line`: what a client is told of an error inside the server
    (the traceback goes to the server's log, never into a response)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An OpenAI-style error object."""
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": error_type(status), "param": param, "code": None}})


def error_type(status: int) -> str:
    """The OpenAI API's name for an error of this HTTP status: the client's, or the server's."""
    return "server_error" if status >= 500 else "invalid_request_error"


# ---------------------------------------------------------------------------------------------
# request bodies (the OpenAI API's fields that labkit supports; others are refused, not ignored)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a last chunk with the token counts, before [DONE]


class Body(BaseModel):
    """The fields a completion and a chat request share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)  # OpenAI's default; 0 is greedy
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)  # an extension, as in vLLM
    seed: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_SAMPLES)  # answers per prompt (parallel sampling)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None  # text that ends the answer (it is not included)
    presence_penalty: float | None = None  # null: 0
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # an extension, as in vLLM (null: 1)
    ignore_eos: bool = False  # an extension, as in vLLM and SGLang: run to max_tokens
    user: str | None = None


class CompletionBody(Body):
    # one prompt, or a list of them (one choice each); text or token ids
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # the answer's text starts with its prompt's
    # the legacy API's k: each token's log-probability and its k most likely alternatives
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # other kinds of part are refused by name

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]  # developer: the system's new name
    content: str | list[ContentPart]


class ChatBody(Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # wins over max_tokens
    logprobs: bool | None = None  # each token's log-probability...
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # ...and k others


# ---------------------------------------------------------------------------------------------
# what a body becomes: the engine's settings, or a 400 that names what is wrong

def logprobs_of(body: Body) -> int | None:
    """How many alternatives each token's log-probability comes with; None: none asked."""
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        k = (body.top_logprobs or 0) if body.logprobs else None
    else:
        k = getattr(body, "logprobs", None)
    if k is not None and body.stream:
        raise BadRequest("logprobs with stream: true is not supported: this server returns "
                         "log-probabilities with a whole answer; ask without stream",
                         "logprobs")
    return k


def params_of(body: Body, ids: list[int], chat: bool, sched: Scheduler,
              default_max_tokens: int | None) -> SamplingParams:
    """The engine's settings for one prompt of `body` (BadRequest if they are out of range)."""
    try:
        return SamplingParams(
            max_new_tokens=max_tokens_of(body, ids, chat, sched, default_max_tokens),
            temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
            ignore_eos=body.ignore_eos, logprobs=logprobs_of(body), n=body.n,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=(body.repetition_penalty
                                if body.repetition_penalty is not None else 1.0),
            seed=body.seed if body.seed is not None else uuid.uuid4().int % 2**63)
    except (TypeError, ValueError) as err:
        raise BadRequest(str(err)) from None


def with_speculation(params: SamplingParams, speculative: str | None) -> SamplingParams:
    """`params` speculating as the server says, where it can (no penalties, no logprobs)."""
    if speculative is None or params.penalized or params.logprobs is not None:
        return params
    return dataclasses.replace(params, speculative=speculative)


def max_tokens_of(body: Body, ids: list[int], chat: bool, sched: Scheduler,
                  default_max_tokens: int | None) -> int:
    """How many tokens to generate: what the body asks; else the server's default; else
    OpenAI's rule, 16 for a completion and for a chat answer all the room that is left."""
    asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if asked is not None:
        return asked
    if default_max_tokens is not None:
        return default_max_tokens
    if not chat:
        return 16  # OpenAI's default for a completion
    # a chat answer may fill what the context and the pool hold
    room = min(sched.context_len, sched.allocator.num_blocks * sched.block_size) - len(ids)
    return max(room, 1)  # a prompt that leaves no room is refused by check_ids


def check_ids(ids: list[int], params: SamplingParams, sched: Scheduler) -> None:
    """BadRequest if the prompt is empty or it and its answer cannot fit (read-only)."""
    if not ids:
        raise BadRequest("the prompt is empty: give at least one token", "prompt")
    context = sched.context_len
    if len(ids) + params.max_new_tokens > context:  # refused, as OpenAI does, not clipped
        raise BadRequest(f"this model's context is {context} tokens; the prompt has "
                         f"{len(ids)} and max_tokens asks for {params.max_new_tokens} more")
    try:  # read-only: the limits, not the pool's state
        sched.check_request(ids, params.max_new_tokens)
    except RequestError as err:
        raise BadRequest(str(err)) from None


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """A request's stop strings as a list, checked (BadRequest names what is wrong)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}",
                         "stop")
    if "" in stops:
        raise BadRequest("stop: a stop string must not be empty (it would match at once)",
                         "stop")
    return stops


def chat_messages(body: ChatBody) -> list[dict[str, str]]:
    """The messages as the chat template takes them: text parts joined by newlines (as vLLM
    does), the developer role as the system role."""
    out = []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            text = m.content
        else:
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise BadRequest(f"messages[{i}].content[{j}]: content parts of type "
                                     f"{part.type!r} are not supported: this server reads text "
                                     "only ('text' parts)", "messages")
                if part.text is None:
                    raise BadRequest(f"messages[{i}].content[{j}]: a 'text' part has no 'text'",
                                     "messages")
            text = "\n".join(part.text for part in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


# ---------------------------------------------------------------------------------------------
# answers


def logprobs_body(done: Completion, tokenizer, text_len: int, cut: bool, chat: bool,
                  offset: int = 0) -> dict | None:
    """A choice's `logprobs` as the OpenAI API spells it (chat: `content`, a list of tokens;
    completions: the legacy parallel lists), or None if it did not ask.

    A token is listed if its text starts inside the answer: after a stop string (`cut`), the
    tokens that the engine generated past it are not part of the answer. The log-probabilities
    are the model's own (see `labkit.sampling.token_logprobs`).
    """
    if done.logprobs is None:
        return None
    detok, pos = tokenizer.detokenizer(), 0
    rows = []  # (token text, its start in the answer, log-probability, [(text, lp)])
    for tok, (lp, top) in zip(done.output_ids, done.logprobs):
        if cut and pos >= text_len:
            break
        piece = detok.push(tok)
        rows.append((tokenizer.decode([tok]), pos, lp,
                     [(tokenizer.decode([i]), x) for i, x in top]))
        pos += len(piece)
    if chat:
        def entry(text: str, lp: float) -> dict:
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}
        return {"content": [entry(t, lp) | {"top_logprobs": [entry(a, x) for a, x in top]}
                            for t, _, lp, top in rows]}
    return {"tokens": [t for t, *_ in rows], "token_logprobs": [lp for _, _, lp, _ in rows],
            "top_logprobs": [dict(top) for *_, top in rows],
            "text_offset": [offset + start for _, start, _, _ in rows]}


def completion_body(rid: str, model: str, chat: bool, texts: list[str],
                    finish_reasons: list[str], usage: dict, echo: list[str] | None,
                    logprobs: list[dict | None] | None = None) -> dict:
    """The whole answer, one choice per text, as the OpenAI API spells it."""
    out = []
    for i, (text, finish) in enumerate(zip(texts, finish_reasons)):
        choice: dict[str, Any] = {"index": i, "finish_reason": finish,
                                  "logprobs": logprobs[i] if logprobs else None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice |= {"text": (echo[i] if echo else "") + text}
        out.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": out, "usage": usage}


def event(payload: dict) -> str:
    """One server-sent event."""
    return "data: " + json.dumps(payload) + "\n\n"


DONE_EVENT = "data: [DONE]\n\n"  # a stream's last event


def error_event(status: int, message: str) -> str:
    """The event that ends a stream that failed (then DONE_EVENT)."""
    return event({"error": {"message": message, "type": error_type(status), "code": status}})


@dataclass(frozen=True)
class Chunks:
    """The chunks of one streamed answer, as the OpenAI API spells them: they share its id, its
    model and the second it was created."""

    rid: str
    model: str
    chat: bool
    created: int

    def head(self) -> dict:
        """The fields every chunk starts with."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, index: int, piece: str | None, finish: str | None,
              first: bool = False) -> str:
        """A piece of choice `index`'s text, or its end (`finish`); a chat answer's first
        chunk names the role and carries no text."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else (
                {"content": piece} if piece is not None else {})
            choice = {"index": index, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": index, "text": piece or "", "logprobs": None,
                      "finish_reason": finish}
        return event({**self.head(), "choices": [choice]})

    def usage(self, usage: dict) -> str:
        """The chunk with no choices and the token counts (`stream_options.include_usage`)."""
        return event({**self.head(), "choices": [], "usage": usage})
