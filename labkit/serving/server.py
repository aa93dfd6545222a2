"""`python -m labkit serve`: an OpenAI-compatible HTTP server over the engine.

The clients a learner already uses (the `openai` package, curl, a vLLM benchmark) speak this
API, so pointing them at labkit shows the engine doing what production servers do. Two threads
share the work, and only one of them ever touches the engine:

- the **HTTP thread** (uvicorn's asyncio loop, this module) parses and validates a request
  (`labkit.serving.protocol`), tokenizes it, and hands a `Job` per prompt to the engine thread;
  it then streams the text back as server-sent events, or waits for the whole completion
  (`labkit.serving.choices` takes the engine's events in);
- the **engine thread** (`labkit.serving.worker`) runs the decode loop and takes new jobs and
  cancels *between steps*, so a request that arrives while others decode joins the running
  batch at the next step: continuous batching, over HTTP.

A client that disconnects cancels its request (its KV pages return once no step in flight
references it, the usual zombie rule): `relay` is that rule, without the asyncio. A bad body
gets a 400 with an OpenAI-style error object that names what is wrong, and nothing else is
affected. A stop string ends an answer just before it (`labkit.stop_text`) and cancels the
request in the engine. If the engine thread dies, every request, queued ones too, gets a
one-line 500 and `/health` a 503; on SIGTERM the requests in flight are cancelled and answered
with a 503, and the server exits.

Endpoints: `POST /v1/completions` (a prompt, or a list of them: one choice each),
`POST /v1/chat/completions` (both with `stream: true`), `GET /v1/models`, `GET /health`.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from labkit.engine import Engine
from labkit.serving.choices import Choices
from labkit.serving.protocol import (
    DONE_EVENT,
    BadRequest,
    Body,
    ChatBody,
    Chunks,
    CompletionBody,
    chat_messages,
    check_ids,
    completion_body,
    error_event,
    error_response,
    logprobs_body,
    one_line,
    params_of,
    stop_strings,
    with_speculation,
)
from labkit.serving.worker import EngineWorker, Job

POLL_S = 0.25  # a request that hears nothing for this long asks whether its client is there
SHUTDOWN_GRACE_S = 5  # on SIGTERM, how long a client still sending its body may take

# ---------------------------------------------------------------------------------------------
# a request's rule: collect its text; a client that has gone cancels it


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
                failure = choices.failure
                return error_response(*failure) if failure is not None else None
        if await request.is_disconnected():
            choices.cancel()
            return error_response(499, "client disconnected")


# ---------------------------------------------------------------------------------------------
# the app


def create_app(engine: Engine, model_name: str, decoder: str = "pipelined",
               default_max_tokens: int | None = None, speculative: str | None = None
               ) -> FastAPI:
    """The HTTP app over `engine`; the engine thread starts and stops with the app.

    default_max_tokens: the max_tokens of a request that gives none; None is OpenAI's rule,
    16 for a completion, and for a chat answer all the room the context (and pool) leaves.
    speculative: "<proposer>:<k>" for every request that can speculate (no penalties, no
    logprobs); the others decode plainly (labkit.speculative)."""
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
            return error_response(400, f"the body is not valid JSON: {first.get('msg')}")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"{where}: this server does not support this field",
                                  where)
        return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                              where)

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> JSONResponse:
        # one line for the client; uvicorn logs the traceback
        return error_response(500, f"internal server error: {one_line(exc)}")

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

    async def answer(request: Request, body: Body, prompts: list[list[int]], chat: bool,
                     echo: list[str] | None = None):
        if body.model not in (None, model_name):
            return error_response(404, f"model {body.model!r} is not served here; this server "
                                       f"has {model_name!r}", "model")
        try:
            stops = stop_strings(body.stop)
            params = [with_speculation(params_of(body, ids, chat, engine.scheduler,
                                                 default_max_tokens), speculative)
                      for ids in prompts]
            for ids, p in zip(prompts, params):
                check_ids(ids, p, engine.scheduler)
        except BadRequest as err:
            return error_response(400, str(err), err.param)
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        jobs: list[Job] = []  # choice i * n + j: sample j of prompt i; samples j > 0 fork
        for ids, p in zip(prompts, params):
            first = Job(ids, p.sample(0), loop, events, index=len(jobs))
            jobs += [first] + [Job(ids, p.sample(j), loop, events, index=len(jobs) + j,
                                   fork_of=first) for j in range(1, body.n)]
        if echo is not None:  # each choice starts with its own prompt's text
            echo = [text for text in echo for _ in range(body.n)]
        try:
            for job in jobs:
                worker.submit(job)
        except RuntimeError as err:
            for job in jobs:
                worker.cancel(job)  # those already queued (the others are left alone)
            return error_response(503, str(err))
        choices = Choices(worker, jobs, stops)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_stream(choices, rid, model_name, chat, usage, echo),
                                     media_type="text/event-stream")
        failed = await _collect(request, choices)
        if failed is not None:
            return failed
        texts = ["".join(pieces) for pieces in choices.texts]
        reasons = [choices.finish_reason(i) for i in range(len(jobs))]
        logprobs = [logprobs_body(done, engine.tokenizer, len(text), job.stopped_by_text, chat,
                                  len(echo[i]) if echo else 0)
                    for i, (done, text, job) in enumerate(zip(choices.done, texts, jobs))]
        return completion_body(rid, model_name, chat, texts, reasons, choices.usage(), echo,
                               logprobs)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        prompt = body.prompt
        several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts = list(prompt) if several else [prompt]
        if prompt == [] or any(p == "" for p in prompts):
            return error_response(400, "prompt is empty", "prompt")
        ids = []
        for i, p in enumerate(prompts):
            try:
                ids.append(engine.tokenizer.encode(p) if isinstance(p, str) else list(p))
            except ValueError as err:
                return error_response(400, f"prompt{f'[{i}]' if several else ''}: {err}",
                                      "prompt")
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in prompts]
        return await answer(request, body, ids, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatBody):
        try:
            ids = engine.tokenizer.encode_chat(chat_messages(body))
        except BadRequest as err:
            return error_response(400, str(err), err.param)
        except ValueError as err:
            return error_response(400, str(err), "messages")
        return await answer(request, body, [ids], chat=True)

    return app


async def _stream(choices: Choices, rid: str, model: str, chat: bool, usage: bool = False,
                  echo: list[str] | None = None) -> AsyncIterator[str]:
    """Server-sent events: one chunk per piece of text, a last one per choice with its finish
    reason (then, if `usage`, one with no choices and the token counts, as OpenAI's API does).
    A failure is an error event, then [DONE]; a client that leaves cancels what still runs."""
    chunks = Chunks(rid, model, chat, created=int(time.time()))
    try:
        for i in range(len(choices.jobs)):
            if chat:
                yield chunks.chunk(i, None, None, first=True)
            elif echo:
                yield chunks.chunk(i, echo[i], None)
        while not choices.over:
            index, kind, value = await choices.events.get()
            text = choices.take(index, kind, value)
            if kind == "failed":
                yield error_event(*value)
                break
            if text:
                yield chunks.chunk(index, text, None)
            if kind == "done":
                yield chunks.chunk(index, None, choices.finish_reason(index))
        if usage and choices.failure is None:
            yield chunks.usage(choices.usage())
        yield DONE_EVENT
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
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="the TCP port to listen on")
    p.add_argument("--device", choices=("inprocess", "process", "cuda"), default="inprocess",
                   help="where the model runs: this process, a simulated accelerator "
                        "process, or a CUDA GPU")
    p.add_argument("--speculative", default=None, metavar="PROPOSER:K",
                   help="speculative decoding for every request that can (no penalties or "
                        "logprobs): int4:K, int8:K (the model's quantized copy drafts) or "
                        "ngram:K (prompt lookup); needs --decoder blocking and --device "
                        "inprocess")
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
    drafts: tuple[str, ...] = ()
    if args.speculative is not None:
        from labkit.sampling import parse_speculative

        try:
            proposer, _ = parse_speculative(args.speculative)
        except ValueError as err:
            p.error(f"--speculative: {err}")
        if args.decoder != "blocking" or args.device != "inprocess":
            p.error("--speculative needs --decoder blocking and --device inprocess: the "
                    "pipelined decoder plans a step before the previous one's accepted tokens "
                    "are known, and the other devices return one token per row")
        drafts = () if proposer == "ngram" else (proposer,)
    try:  # before the model loads: a port in use fails at once, in one line
        sock = _listening_socket(args.host, args.port)
    except OSError as err:
        print(f"python -m labkit serve: error: cannot listen on {args.host}:{args.port}: "
              f"{err.strerror or err}", file=sys.stderr)
        return 1
    from labkit.loading import load_model

    try:
        model, tok = load_model(args.model, quant=engine_kw.pop("quant"), fuse=True)
        copies = {name: load_model(args.model, quant=name)[0] for name in drafts}
        engine = Engine(model, tok, device=args.device, drafts=copies, **engine_kw)
    except (ValueError, RuntimeError, OSError) as err:
        sock.close()
        print(f"python -m labkit serve: error: {err}", file=sys.stderr)
        return 2
    app = create_app(engine, args.model, args.decoder, args.max_tokens, args.speculative)
    budget = engine_kw["max_step_tokens"]
    server = _uvicorn_server(app, (
        f"[labkit] serving {args.model} on http://{args.host}:{sock.getsockname()[1]}/v1 "
        f"({args.decoder} decoder, {args.batching} batching, budget {budget} tokens/step, "
        f"{args.attention} attention, weights {args.quant}"
        f"{f', speculative {args.speculative}' if args.speculative else ''})"))
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
