"""`python -m labkit serve`: an OpenAI-compatible HTTP server over the engine.

The clients a learner already uses (the `openai` package, curl, a vLLM benchmark) speak this
API, so pointing them at labkit shows the engine doing what production servers do. Two threads
share the work, and only one of them ever touches the engine:

- the **HTTP thread** (uvicorn's asyncio loop) parses and validates a request, tokenizes it, and
  hands a `Job` to the engine thread; it then streams the job's text back as server-sent events,
  or waits for the whole completion;
- the **engine thread** (`EngineWorker`) runs the decode loop. New jobs and cancels wait in an
  inbox that the loop drains *between steps* (`engine.on_step`), so a request that arrives while
  others decode joins the running batch at the next step: continuous batching, over HTTP.

A client that disconnects cancels its request (its KV pages return once no step in flight
references it, the usual zombie rule). A bad body gets a 400 with an OpenAI-style error object
that names what is wrong, and nothing else is affected. A stop string ends an answer just
before it (`labkit.stop_text`) and cancels the request in the engine. If the engine thread
dies, every request, queued ones too, gets a one-line 500 and `/health` a 503; on SIGTERM the
requests in flight are cancelled and answered with a 503, and the server exits.

Endpoints: `POST /v1/completions` (a prompt, or a list of them: one choice each),
`POST /v1/chat/completions` (both with `stream: true`), `GET /v1/models`, `GET /health`.
"""

from __future__ import annotations

import asyncio
import json
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from labkit.decoders import run
from labkit.engine import Completion, Engine
from labkit.sampling import SamplingParams
from labkit.scheduler import RequestError
from labkit.stop_text import StopText

POLL_S = 0.25  # a request that hears nothing for this long asks whether its client is there
MAX_STOP_STRINGS = 4  # as OpenAI's API
SHUTDOWN_GRACE_S = 5  # on SIGTERM, how long a client still sending its body may take


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


# ---------------------------------------------------------------------------------------------
# the engine thread


@dataclass(eq=False)
class Job:
    """One prompt of an HTTP request inside the engine: its ids and settings, and where its
    events go: (index, "text", piece), (index, "done", completion) or (index, "failed",
    (http status, one-line message)). The prompts of one request share one queue."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    index: int = 0  # the choice it answers
    request_id: int | None = None
    stopped_by_text: bool = False  # the HTTP side met a stop string and cancelled it

    def send(self, kind: str, value: Any) -> None:
        """Deliver an event to the HTTP side (called from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, value))
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass


class EngineWorker:
    """Runs the engine's decode loop in its own thread; jobs and cancels arrive between steps."""

    def __init__(self, engine: Engine, decoder: str = "pipelined"):
        self.engine, self.decoder = engine, decoder
        self._inbox: queue.Queue[tuple[str, Job | None]] = queue.Queue()
        self._jobs: dict[int, Job] = {}  # engine request id -> its job, until it is delivered
        self._to_forget: list[int] = []  # delivered, record dropped once its pages are back
        self._thread = threading.Thread(target=self._main, name="labkit-engine", daemon=True)
        # set once, under the lock that `submit` holds: after it no job enters the inbox
        self._lock = threading.Lock()
        self.failure: str | None = None  # one line: the loop itself died (every job failed)
        self.closing: str | None = None  # one line: shutting down (every job cancelled)
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "cancelled": 0}  # by reason

    def start(self) -> EngineWorker:
        """Start the engine thread."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine thread to finish what it runs, then stop."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queue a job (any thread); RuntimeError (one line) if the engine takes no more."""
        with self._lock:
            if self.failure is not None or self.closing is not None:
                raise RuntimeError(self.failure or self.closing)
            self._inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """Cancel a job at any moment (any thread); a finished one is left alone."""
        self._inbox.put(("cancel", job))

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """Refuse new jobs; cancel every job that runs or waits, answering each with a 503
        (any thread). The thread itself runs on until `stop`."""
        with self._lock:
            self.closing = reason
        self._inbox.put(("shutdown", None))

    # -- inside the engine thread ----------------------------------------------------------

    def _main(self) -> None:
        engine = self.engine
        engine.on_step = lambda _engine: self._between_steps()
        engine.on_text = self._on_text
        try:
            while True:
                kind, job = self._inbox.get()  # idle: sleep until a request comes
                if not self._apply(kind, job):
                    return
                self._between_steps()
                if not engine.scheduler.idle():
                    run(engine, self.decoder)  # returns once every request has finished
                self._between_steps()
        except BaseException as err:  # noqa: BLE001 - every waiting client is told, then raised
            self._fail(f"the engine failed: {one_line(err)}")
            raise  # the thread's traceback goes to the server's log

    def _fail(self, message: str) -> None:
        """Answer every job, running or still in the inbox, with a 500; refuse new ones."""
        with self._lock:
            self.failure = message
        for job in self._jobs.values():
            job.send("failed", (500, message))
        self._jobs.clear()
        while True:  # the queued ones too: the lock keeps any new job out of the inbox now
            try:
                kind, job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                job.send("failed", (500, message))

    def _apply(self, kind: str, job: Job | None) -> bool:
        """Carry out one inbox command; False means stop."""
        if kind == "stop":
            return False
        if kind == "shutdown":
            for rid, running in self._jobs.items():
                self.engine.cancel(rid)
                running.send("failed", (503, self.closing))
            return True
        assert job is not None
        if kind == "submit":
            try:
                job.request_id = self.engine.submit(job.prompt_ids, job.params)
            except (RequestError, ValueError) as err:
                job.send("failed", (400, str(err)))
                return True
            except BaseException as err:  # the engine is broken: this job is answered too
                job.send("failed", (500, f"the engine failed: {one_line(err)}"))
                raise
            self._jobs[job.request_id] = job
        elif kind == "cancel" and job.request_id in self._jobs:
            self.engine.cancel(job.request_id)
        return True

    def _between_steps(self) -> None:
        """Take in new jobs and cancels; deliver what has finished; forget what is released."""
        while True:
            try:
                kind, job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if not self._apply(kind, job):
                self._inbox.put(("stop", None))  # stop once the running requests are done
                break
        engine = self.engine
        for rid in [r for r, j in self._jobs.items() if engine.seqs[r].finalized]:
            job = self._jobs.pop(rid)
            done = engine.completion(rid)
            self.finished["stop" if job.stopped_by_text else done.finish_reason] += 1
            job.send("done", done)
            self._to_forget.append(rid)
        keep = []
        for rid in self._to_forget:
            if engine.seqs[rid].released:
                engine.forget(rid)
            else:
                keep.append(rid)  # a zombie row of a step in flight still holds its pages
        self._to_forget = keep

    def _on_text(self, request_id: int, text: str) -> None:
        job = self._jobs.get(request_id)
        if job is not None:
            job.send("text", text)


# ---------------------------------------------------------------------------------------------
# request bodies (the OpenAI API's fields that labkit supports; others are refused, not ignored)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a last chunk with the token counts, before [DONE]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)  # OpenAI's default; 0 is greedy
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)  # an extension, as in vLLM
    seed: int | None = Field(default=None, ge=0)
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None  # text that ends the answer (it is not included)
    # accepted at their no-op values only, for now (NOT_YET)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # an extension, as in vLLM
    ignore_eos: bool = False  # an extension, as in vLLM and SGLang: run to max_tokens
    user: str | None = None


class CompletionBody(_Body):
    # one prompt, or a list of them (one choice each); text or token ids
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # the answer's text starts with its prompt's
    logprobs: int | None = None  # NOT_YET


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # other kinds of part are refused by name

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]  # developer: the system's new name
    content: str | list[ContentPart]


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # wins over max_tokens
    logprobs: bool | None = None  # NOT_YET
    top_logprobs: int | None = None  # NOT_YET


# Parameters that OpenAI clients send but labkit's sampler does not have yet: accepted at their
# no-op values, refused with a 400 that names them otherwise. The one place to change when
# `labkit.sampling` learns one: drop its line here and pass it on in `params_of`.
NOT_YET: dict[str, tuple[str, Callable[[Any], bool]]] = {  # name -> (no-op value, is no-op?)
    "presence_penalty": ("0", lambda v: v is None or v == 0),
    "frequency_penalty": ("0", lambda v: v is None or v == 0),
    "repetition_penalty": ("1", lambda v: v is None or v == 1),
    "logprobs": ("null or false", lambda v: v is None or v is False),
    "top_logprobs": ("null", lambda v: v is None),
}


def refuse_not_yet(body: _Body) -> None:
    """BadRequest naming the first parameter in NOT_YET that is set to more than a no-op."""
    for name, (noop, is_noop) in NOT_YET.items():
        value = getattr(body, name, None)
        if not is_noop(value):
            raise BadRequest(f"{name}={json.dumps(value)} is not supported yet: labkit's "
                             f"sampler does not implement it ({name}={noop} is accepted)", name)


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


def relay(next_event: Callable[[float], tuple[str, Any] | None],
          is_disconnected: Callable[[], bool], cancel: Callable[[], None],
          poll_s: float = POLL_S) -> tuple[list[str], Any] | None:
    """A request handler's rule, without the asyncio: collect a request's text until it is
    done; a client that has gone cancels it, once, and only while it still runs.

    next_event(timeout) returns ("text", piece), ("done", completion) or None (nothing came
    within `timeout` s). The client is asked after every piece as well as after every quiet
    poll: while tokens flow nothing is ever quiet, and a rule that asks only when idle lets a
    long answer run to its end for nobody. Returns (pieces, completion), or None once the
    client has left (the chapter-08 exercise's reference; `_collect` follows it)."""
    pieces: list[str] = []
    while True:
        event = next_event(poll_s)
        if event is not None:
            kind, value = event
            if kind != "text":  # done: the engine has released it (or will): never cancel it
                return pieces, value
            pieces.append(value)
        if is_disconnected():  # after every piece, and after every quiet poll
            cancel()  # the engine frees its pages once no step in flight holds them
            return None


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An OpenAI-style error object."""
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": _error_type(status), "param": param, "code": None}})


def _error_type(status: int) -> str:
    return "server_error" if status >= 500 else "invalid_request_error"


class Choices:
    """The answers to one HTTP request, one per prompt, as the engine's events arrive. Each
    choice's text goes through its stop strings; a stop string cancels that choice's job."""

    def __init__(self, worker: EngineWorker, jobs: list[Job], stops: list[str]):
        self.worker, self.jobs, self.events = worker, jobs, jobs[0].events
        self.cutters = [StopText(stops) for _ in jobs]
        self.texts: list[list[str]] = [[] for _ in jobs]
        self.done: list[Completion | None] = [None] * len(jobs)
        self.failure: tuple[int, str] | None = None  # (http status, message)

    @property
    def over(self) -> bool:
        """Every choice is done, or one failed (and the others were cancelled)."""
        return self.failure is not None or all(d is not None for d in self.done)

    def take(self, index: int, kind: str, value: Any) -> str:
        """Apply one event; returns the text it releases for choice `index` ("" if none)."""
        if kind == "failed":
            self.failure = value
            self.cancel()  # the request's other prompts
            return ""
        cutter, job = self.cutters[index], self.jobs[index]
        if kind == "text":
            text, stopped = cutter.push(value)
            if stopped and not job.stopped_by_text:
                job.stopped_by_text = True
                self.worker.cancel(job)  # the engine stops it at its next step
        else:  # done
            text = cutter.flush()
            self.done[index] = value
        self.texts[index].append(text)
        return text

    def finish_reason(self, index: int) -> str:
        """OpenAI's finish reason of a done choice: "length", or "stop" (EOS, a stop string)."""
        if self.jobs[index].stopped_by_text:
            return "stop"
        done = self.done[index]
        return "length" if done is not None and done.finish_reason == "length" else "stop"

    def cancel(self) -> None:
        """Cancel every choice that has not finished (its client left, a sibling failed)."""
        for job, done in zip(self.jobs, self.done):
            if done is None:
                self.worker.cancel(job)

    def usage(self) -> dict:
        """The token counts, summed over the choices."""
        n_in = sum(len(c.prompt_ids) for c in self.done if c is not None)
        n_out = sum(len(c.output_ids) for c in self.done if c is not None)
        return {"prompt_tokens": n_in, "completion_tokens": n_out,
                "total_tokens": n_in + n_out}


async def _collect(request: Request, choices: Choices) -> JSONResponse | None:
    """Wait for every choice, by `relay`'s rule: after each event, and after POLL_S with none,
    a client that has gone cancels what still runs. An error response, or None when done."""
    while True:
        try:
            event = await asyncio.wait_for(choices.events.get(), timeout=POLL_S)
        except TimeoutError:
            event = None
        if event is not None:
            choices.take(*event)
            if choices.over:  # finished: never cancel
                return _error(*choices.failure) if choices.failure is not None else None
        if await request.is_disconnected():
            choices.cancel()
            return _error(499, "client disconnected")


# ---------------------------------------------------------------------------------------------
# the app


def create_app(engine: Engine, model_name: str, decoder: str = "pipelined",
               default_max_tokens: int | None = None) -> FastAPI:
    """The HTTP app over `engine`; the engine thread starts and stops with the app.

    default_max_tokens: the max_tokens of a request that gives none; None is OpenAI's rule,
    16 for a completion, and for a chat answer all the room the context (and pool) leaves."""
    worker = EngineWorker(engine, decoder)

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="labkit", lifespan=lifespan)
    app.state.worker = worker

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {first.get('msg')}")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        if first.get("type") == "extra_forbidden":
            return _error(400, f"{where}: this server does not support this field", where)
        return _error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", where)

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> JSONResponse:
        # one line for the client; uvicorn logs the traceback
        return _error(500, f"internal server error: {one_line(exc)}")

    @app.get("/health")
    async def health():
        sched = engine.scheduler
        state = {"status": "ok", "model": model_name, "running": len(sched.running),
                 "waiting": len(sched.waiting), "finished": dict(worker.finished)}
        trouble = worker.failure or worker.closing
        if trouble is not None:
            return JSONResponse(status_code=503, content={
                **state, "status": "failed" if worker.failure else "closing", "error": trouble})
        return state

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "labkit"}]}

    def max_tokens_of(body: _Body, ids: list[int], chat: bool) -> int:
        asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if asked is not None:
            return asked
        if default_max_tokens is not None:
            return default_max_tokens
        if not chat:
            return 16  # OpenAI's default for a completion
        sched = engine.scheduler  # a chat answer may fill what the context and the pool hold
        room = min(sched.context_len, sched.allocator.num_blocks * sched.block_size) - len(ids)
        return max(room, 1)  # a prompt that leaves no room is refused by check_ids

    def params_of(body: _Body, ids: list[int], chat: bool) -> SamplingParams:
        try:
            return SamplingParams(
                max_new_tokens=max_tokens_of(body, ids, chat),
                temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                ignore_eos=body.ignore_eos,
                seed=body.seed if body.seed is not None else uuid.uuid4().int % 2**63)
        except (TypeError, ValueError) as err:
            raise BadRequest(str(err)) from None

    def check_ids(ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise BadRequest("the prompt is empty: give at least one token", "prompt")
        context = engine.scheduler.context_len
        if len(ids) + params.max_new_tokens > context:  # refused, as OpenAI does, not clipped
            raise BadRequest(f"this model's context is {context} tokens; the prompt has "
                             f"{len(ids)} and max_tokens asks for {params.max_new_tokens} more")
        try:  # read-only: the limits, not the pool's state
            engine.scheduler.check_request(ids, params.max_new_tokens)
        except RequestError as err:
            raise BadRequest(str(err)) from None

    async def answer(request: Request, body: _Body, prompts: list[list[int]], chat: bool,
                     echo: list[str] | None = None):
        if body.model not in (None, model_name):
            return _error(404, f"model {body.model!r} is not served here; this server has "
                               f"{model_name!r}", "model")
        try:
            refuse_not_yet(body)
            stops = stop_strings(body.stop)
            params = [params_of(body, ids, chat) for ids in prompts]
            for ids, p in zip(prompts, params):
                check_ids(ids, p)
        except BadRequest as err:
            return _error(400, str(err), err.param)
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, p, loop, events, index=i)
                for i, (ids, p) in enumerate(zip(prompts, params))]
        try:
            for job in jobs:
                worker.submit(job)
        except RuntimeError as err:
            for job in jobs:
                worker.cancel(job)  # those already queued (the others are left alone)
            return _error(503, str(err))
        choices = Choices(worker, jobs, stops)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_stream(choices, rid, model_name, chat, usage, echo),
                                     media_type="text/event-stream")
        failed = await _collect(request, choices)
        if failed is not None:
            return failed
        return _completion_body(choices, rid, model_name, chat, echo)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        prompt = body.prompt
        several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts = list(prompt) if several else [prompt]
        if prompt == [] or any(p == "" for p in prompts):
            return _error(400, "prompt is empty", "prompt")
        ids = []
        for i, p in enumerate(prompts):
            try:
                ids.append(engine.tokenizer.encode(p) if isinstance(p, str) else list(p))
            except ValueError as err:
                return _error(400, f"prompt{f'[{i}]' if several else ''}: {err}", "prompt")
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in prompts]
        return await answer(request, body, ids, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatBody):
        try:
            ids = engine.tokenizer.encode_chat(chat_messages(body))
        except BadRequest as err:
            return _error(400, str(err), err.param)
        except ValueError as err:
            return _error(400, str(err), "messages")
        return await answer(request, body, [ids], chat=True)

    return app


def _completion_body(choices: Choices, rid: str, model: str, chat: bool,
                     echo: list[str] | None) -> dict:
    """The whole answer, as the OpenAI API spells it."""
    out = []
    for i, pieces in enumerate(choices.texts):
        choice: dict[str, Any] = {"index": i, "finish_reason": choices.finish_reason(i)}
        text = "".join(pieces)
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice |= {"text": (echo[i] if echo else "") + text, "logprobs": None}
        out.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": out,
            "usage": choices.usage()}


async def _stream(choices: Choices, rid: str, model: str, chat: bool, usage: bool = False,
                  echo: list[str] | None = None) -> AsyncIterator[str]:
    """Server-sent events: one chunk per piece of text, a last one per choice with its finish
    reason (then, if `usage`, one with no choices and the token counts, as OpenAI's API does).
    A failure is an error event, then [DONE]; a client that leaves cancels what still runs."""
    created = int(time.time())
    kind_name = "chat.completion.chunk" if chat else "text_completion"

    def event(payload: dict) -> str:
        return "data: " + json.dumps(payload) + "\n\n"

    def chunk(index: int, piece: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else (
                {"content": piece} if piece is not None else {})
            choice = {"index": index, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": index, "text": piece or "", "logprobs": None,
                      "finish_reason": finish}
        return event({"id": rid, "object": kind_name, "created": created, "model": model,
                      "choices": [choice]})

    try:
        for i in range(len(choices.jobs)):
            if chat:
                yield chunk(i, None, None, first=True)
            elif echo:
                yield chunk(i, echo[i], None)
        while not choices.over:
            index, kind, value = await choices.events.get()
            text = choices.take(index, kind, value)
            if kind == "failed":
                status, message = value
                yield event({"error": {"message": message, "type": _error_type(status),
                                       "code": status}})
                break
            if text:
                yield chunk(index, text, None)
            if kind == "done":
                yield chunk(index, None, choices.finish_reason(index))
        if usage and choices.failure is None:
            yield event({"id": rid, "object": kind_name, "created": created, "model": model,
                         "choices": [], "usage": choices.usage()})
        yield "data: [DONE]\n\n"
    finally:
        choices.cancel()  # no-op once every choice is done; else its client went away


# ---------------------------------------------------------------------------------------------
# python -m labkit serve


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), as uvicorn would bind it (OSError if it cannot be)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _uvicorn_server(app: FastAPI, banner: str):
    """uvicorn's server for `app`: the banner once it listens; on SIGINT or SIGTERM every
    request in flight is cancelled and answered (503) before uvicorn waits for connections,
    and a client still sending its body gets SHUTDOWN_GRACE_S seconds."""
    import uvicorn

    worker: EngineWorker = app.state.worker

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(banner, file=sys.stderr, flush=True)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            worker.shutdown("the server is shutting down: the request was cancelled")
            await super().shutdown(sockets)

    return Server(uvicorn.Config(app, log_level="warning",
                                 timeout_graceful_shutdown=SHUTDOWN_GRACE_S))


def serve_main(argv: list[str]) -> int:
    """Entry point of `python -m labkit serve`."""
    from labkit.cli_parser import add_engine_flags, command_parser, engine_kwargs

    p = command_parser("python -m labkit serve", "An OpenAI-compatible HTTP server over "
                       "labkit's engine (/v1/completions, /v1/chat/completions).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", choices=("inprocess", "process", "cuda"), default="inprocess")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max_tokens when a request does not say (default: OpenAI's, 16 for a "
                        "completion, the room left in the context for a chat answer)")
    # the engine's features (labkit.whole_engine): all on by default but quantization
    add_engine_flags(p, decoder="pipelined", budget_may_be_none=True)
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        p.error(f"--port must be in [0, 65536), got {args.port}")
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        engine_kw = engine_kwargs(args)
    except ValueError as err:
        p.error(str(err))
    try:  # before the model loads: a port in use fails at once, in one line
        sock = _listening_socket(args.host, args.port)
    except OSError as err:
        print(f"python -m labkit serve: error: cannot listen on {args.host}:{args.port}: "
              f"{err.strerror or err}", file=sys.stderr)
        return 1
    from labkit.loading import load_model

    try:
        model, tok = load_model(args.model, quant=engine_kw.pop("quant"))
        engine = Engine(model, tok, device=args.device, **engine_kw)
    except (ValueError, RuntimeError, OSError) as err:
        sock.close()
        print(f"python -m labkit serve: error: {err}", file=sys.stderr)
        return 2
    app = create_app(engine, args.model, args.decoder, args.max_tokens)
    budget = engine_kw["max_step_tokens"]
    server = _uvicorn_server(app, (
        f"[labkit] serving {args.model} on http://{args.host}:{sock.getsockname()[1]}/v1 "
        f"({args.decoder} decoder, {args.batching} batching, budget {budget} tokens/step, "
        f"{args.attention} attention, weights {args.quant})"))
    # uvicorn shuts down gracefully on SIGINT and SIGTERM, then raises the signal again for the
    # handler that was in place before it: by then all that is left is to return
    before = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        engine.close()
    return 0
