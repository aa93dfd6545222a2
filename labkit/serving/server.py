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
references it, the usual zombie rule). A bad body gets a 400 with an OpenAI-style error object,
and nothing else is affected.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true`),
`GET /v1/models`, `GET /health`.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import traceback
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


class BadRequest(ValueError):
    """A request the server refuses with a 400 (the message is shown to the client)."""


# ---------------------------------------------------------------------------------------------
# the engine thread


@dataclass(eq=False)
class Job:
    """One HTTP request inside the engine: its ids and settings, and where its events go."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("text"|"done"|"error", x)
    request_id: int | None = None
    finished: bool = False  # set by the HTTP side once it has seen "done" or "error"

    def send(self, kind: str, value: Any) -> None:
        """Deliver an event to the HTTP side (called from the engine thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class EngineWorker:
    """Runs the engine's decode loop in its own thread; jobs and cancels arrive between steps."""

    def __init__(self, engine: Engine, decoder: str = "pipelined"):
        self.engine, self.decoder = engine, decoder
        self._inbox: queue.Queue[tuple[str, Job | None]] = queue.Queue()
        self._jobs: dict[int, Job] = {}  # engine request id -> its job, until it is delivered
        self._to_forget: list[int] = []  # delivered, record dropped once its pages are back
        self._thread = threading.Thread(target=self._main, name="labkit-engine", daemon=True)
        self.failure: str | None = None  # set if the loop itself died (every job then fails)
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
        """Queue a job (any thread)."""
        if self.failure is not None:
            raise RuntimeError(f"the engine thread has stopped: {self.failure}")
        self._inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """Cancel a job at any moment (any thread); a finished one is left alone."""
        self._inbox.put(("cancel", job))

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
        except BaseException:  # noqa: BLE001 - reported to every waiting client, then re-raised
            self.failure = traceback.format_exc(limit=4)
            for job in self._jobs.values():
                job.send("error", f"the engine failed: {self.failure}")
            raise

    def _apply(self, kind: str, job: Job | None) -> bool:
        """Carry out one inbox command; False means stop."""
        if kind == "stop":
            return False
        assert job is not None
        if kind == "submit":
            try:
                job.request_id = self.engine.submit(job.prompt_ids, job.params)
            except (RequestError, ValueError) as err:
                job.send("error", str(err))
                return True
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
            self.finished[done.finish_reason] += 1
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
    ignore_eos: bool = False  # an extension, as in vLLM and SGLang: run to max_tokens
    user: str | None = None


class CompletionBody(_Body):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)


def relay(next_event: Callable[[float], tuple[str, Any] | None],
          is_disconnected: Callable[[], bool], cancel: Callable[[], None],
          poll_s: float = 0.25) -> tuple[list[str], Any] | None:
    """A request handler's rule, without the asyncio: collect a request's text until it is
    done; a client that has gone cancels it, once, and only while it still runs.

    next_event(timeout) returns ("text", piece), ("done", completion) or None (nothing came
    within `timeout` s). Returns (pieces, completion), or None once the client has left (the
    chapter-08 exercise's reference; the async handler in `create_app` follows it)."""
    pieces: list[str] = []
    while True:
        event = next_event(poll_s)
        if event is None:  # quiet: is anyone still listening?
            if is_disconnected():
                cancel()  # the engine frees its pages once no step in flight holds them
                return None
            continue
        kind, value = event
        if kind == "text":
            pieces.append(value)
        else:  # done: the engine has released it (or will): never cancel a finished request
            return pieces, value


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An OpenAI-style error object."""
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": "invalid_request_error", "param": param, "code": None}})


# ---------------------------------------------------------------------------------------------
# the app


def create_app(engine: Engine, model_name: str, decoder: str = "pipelined",
               default_max_tokens: int = 16) -> FastAPI:
    """The HTTP app over `engine`; the engine thread starts and stops with the app."""
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
        return _error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", where)

    @app.get("/health")
    async def health() -> dict:
        sched = engine.scheduler
        return {"status": "ok" if worker.failure is None else "failed", "model": model_name,
                "running": len(sched.running), "waiting": len(sched.waiting),
                "finished": dict(worker.finished)}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "labkit"}]}

    def params_of(body: _Body) -> SamplingParams:
        try:
            return SamplingParams(
                max_new_tokens=body.max_tokens or default_max_tokens,
                temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                ignore_eos=body.ignore_eos,
                seed=body.seed if body.seed is not None else uuid.uuid4().int % 2**63)
        except (TypeError, ValueError) as err:
            raise BadRequest(str(err)) from None

    def check_ids(ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise BadRequest("the prompt is empty: give at least one token")
        context = engine.scheduler.context_len
        if len(ids) + params.max_new_tokens > context:  # refused, as OpenAI does, not clipped
            raise BadRequest(f"this model's context is {context} tokens; the prompt has "
                             f"{len(ids)} and max_tokens asks for {params.max_new_tokens} more")
        try:  # read-only: the limits, not the pool's state
            engine.scheduler.check_request(ids, params.max_new_tokens)
        except RequestError as err:
            raise BadRequest(str(err)) from None

    async def answer(request: Request, body: _Body, ids: list[int], chat: bool):
        if body.model not in (None, model_name):
            return _error(404, f"model {body.model!r} is not served here; this server has "
                               f"{model_name!r}", "model")
        try:
            params = params_of(body)
            check_ids(ids, params)
        except BadRequest as err:
            return _error(400, str(err))
        job = Job(ids, params, asyncio.get_running_loop())
        try:
            worker.submit(job)
        except RuntimeError as err:
            return _error(503, str(err))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_stream(request, worker, job, rid, model_name, chat, usage),
                                     media_type="text/event-stream")
        text, done = [], None
        while done is None:
            try:  # poll for a disconnect: a client that has gone cancels its request
                kind, value = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except TimeoutError:
                if await request.is_disconnected():
                    worker.cancel(job)
                    return _error(499, "client disconnected")
                continue
            if kind == "text":
                text.append(value)
            elif kind == "error":
                return _error(400, value)
            else:
                done = value
        return _completion_body(done, rid, model_name, chat)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        if isinstance(body.prompt, str):
            if not body.prompt:
                return _error(400, "prompt is empty", "prompt")
            ids = engine.tokenizer.encode(body.prompt)
        else:
            ids = list(body.prompt)
        return await answer(request, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatBody):
        try:
            ids = engine.tokenizer.encode_chat([m.model_dump() for m in body.messages])
        except ValueError as err:
            return _error(400, str(err), "messages")
        return await answer(request, body, ids, chat=True)

    return app


def _finish_reason(c: Completion) -> str:
    return "length" if c.finish_reason == "length" else "stop"


def _usage(c: Completion) -> dict:
    n_in, n_out = len(c.prompt_ids), len(c.output_ids)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def _completion_body(c: Completion, rid: str, model: str, chat: bool) -> dict:
    """The whole answer, as the OpenAI API spells it."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish_reason(c)}
    if chat:
        choice["message"] = {"role": "assistant", "content": c.text}
    else:
        choice |= {"text": c.text, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": _usage(c)}


async def _stream(request: Request, worker: EngineWorker, job: Job, rid: str, model: str,
                  chat: bool, usage: bool = False) -> AsyncIterator[str]:
    """Server-sent events: one chunk per piece of text, a last one with the finish reason
    (then, if `usage`, one with no choices and the token counts, as OpenAI's API does)."""
    created = int(time.time())
    kind_name = "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else (
                {"content": piece} if piece is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
        return "data: " + json.dumps({"id": rid, "object": kind_name, "created": created,
                                      "model": model, "choices": [choice]}) + "\n\n"

    try:
        if chat:
            yield chunk(None, None, first=True)
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield chunk(value, None)
            elif kind == "error":
                yield "data: " + json.dumps({"error": {"message": value,
                                                       "type": "invalid_request_error"}}) + "\n\n"
                break
            else:
                yield chunk(None, _finish_reason(value))
                if usage:
                    yield "data: " + json.dumps({"id": rid, "object": kind_name,
                                                 "created": created, "model": model,
                                                 "choices": [], "usage": _usage(value)}) + "\n\n"
                break
        job.finished = True
        yield "data: [DONE]\n\n"
    finally:
        if not job.finished:  # the client went away mid-stream (the generator was closed)
            worker.cancel(job)


# ---------------------------------------------------------------------------------------------
# python -m labkit serve


def serve_main(argv: list[str]) -> int:
    """Entry point of `python -m labkit serve`."""
    import sys

    from labkit.cli_parser import add_engine_flags, command_parser, engine_kwargs

    p = command_parser("python -m labkit serve", "An OpenAI-compatible HTTP server over "
                       "labkit's engine (/v1/completions, /v1/chat/completions).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", choices=("inprocess", "process", "cuda"), default="inprocess")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="max_tokens when a request does not say")
    # the engine's features (labkit.whole_engine): all on by default but quantization
    add_engine_flags(p, decoder="pipelined", budget_may_be_none=True)
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        p.error(f"--port must be in [0, 65536), got {args.port}")
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        engine_kw = engine_kwargs(args)
    except ValueError as err:
        p.error(str(err))
    import uvicorn

    from labkit.loading import load_model

    try:
        model, tok = load_model(args.model, quant=engine_kw.pop("quant"))
        engine = Engine(model, tok, device=args.device, **engine_kw)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"python -m labkit serve: error: {err}", file=sys.stderr)
        return 2
    app = create_app(engine, args.model, args.decoder, args.max_tokens)
    budget = engine_kw["max_step_tokens"]
    print(f"[labkit] serving {args.model} on http://{args.host}:{args.port}/v1 "
          f"({args.decoder} decoder, {args.batching} batching, budget {budget} tokens/step, "
          f"{args.attention} attention, weights {args.quant})", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.close()
    return 0
