"""The server's API surface and its failures, in process: `create_app` over the tiny model under
uvicorn in a thread, spoken to over HTTP. What OpenAI clients and benchmarks send is accepted;
what labkit cannot do is refused with a 400 that names it; an engine that dies answers every
request with a one-line 5xx."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from tests.deadline import deadline
from tests.test_server import Server

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

KV_TOKENS = 256  # a pool smaller than tiny's context (1024): a chat answer's room is the pool's


class ThreadServer(Server):
    """`create_app(engine)` under uvicorn in a thread of this process (Server's HTTP helpers)."""

    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert time.monotonic() - t0 < 30, "uvicorn did not start within 30 s"
            time.sleep(0.02)

    def conn(self):
        import http.client

        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def tiny_app(**engine_kw):
    from labkit.engine import Engine
    from labkit.loading import load_model
    from labkit.serving.server import create_app

    model, tok = load_model("tiny")
    return create_app(Engine(model, tok, kv_tokens=KV_TOKENS, **engine_kw), "tiny")


@pytest.fixture(scope="module")
def server():
    s = ThreadServer(tiny_app())
    yield s
    s.close()
    s.app.state.worker.engine.close()


def post(server, path, body, seconds=60):
    with deadline(seconds, f"POST {path}"):
        return server.post(path, body)


def stream(server, path, body, seconds=60):
    with deadline(seconds, f"streamed POST {path}"):
        return server.stream(path, body)


def greedy(**kw):
    return {"temperature": 0, **kw}


# ---------------------------------------------------------------------------------------------
# what OpenAI clients and benchmarks send


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"stop": "\n"}),
    ("/v1/completions", {"stop": ["a", "bb", "ccc", "dddd"]}),
    ("/v1/completions", {"presence_penalty": 0, "frequency_penalty": 0.0,
                         "repetition_penalty": 1}),
    ("/v1/completions", {"logprobs": None, "echo": False}),
    ("/v1/chat/completions", {"max_completion_tokens": 4}),
    ("/v1/chat/completions", {"logprobs": None, "top_logprobs": None}),
    ("/v1/chat/completions", {"logprobs": False}),
    ("/v1/chat/completions", {"presence_penalty": 0, "frequency_penalty": 0}),
])
def test_what_openai_clients_send_is_accepted(server, path, body):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body}
    else:
        body = {"prompt": "Hi", "max_tokens": 4, **body}
    status, out = post(server, path, greedy(**body))
    assert status == 200, f"{body} refused: {out}"


def test_stop_strings_cut_the_text_and_stop_the_engine(server):
    full = post(server, "/v1/completions", greedy(prompt="Once", max_tokens=30,
                                                  ignore_eos=True))[1]["choices"][0]["text"]
    assert len(full) > 20, full
    stop = full[8:12]  # spans token boundaries: the tiny model's tokens are 1-4 characters
    want = full[:full.index(stop)]
    body = greedy(prompt="Once", max_tokens=200, ignore_eos=True, stop=["never-there", stop])
    status, out = post(server, "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["text"] == want, f"stop {stop!r}: got {choice['text']!r}, want {want!r}"
    assert choice["finish_reason"] == "stop"
    # the engine was told: it stopped long before max_tokens (ignore_eos would run to 200)
    assert out["usage"]["completion_tokens"] < 100, (
        f"a stop string must cancel the request in the engine: {out['usage']}")
    events = stream(server, "/v1/completions", body)
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want, (
        "the streamed pieces must concatenate to the text before the stop string")
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # chat too
    chat = greedy(messages=[{"role": "user", "content": "Once"}], max_tokens=30,
                  ignore_eos=True)
    chat_full = post(server, "/v1/chat/completions", chat)[1]["choices"][0]["message"]
    stop = chat_full["content"][10:13]
    chat_want = chat_full["content"][:chat_full["content"].index(stop)]
    out = post(server, "/v1/chat/completions", {**chat, "stop": stop})[1]
    assert out["choices"][0]["message"]["content"] == chat_want
    assert out["choices"][0]["finish_reason"] == "stop"
    deltas = [e["choices"][0]["delta"] for e in stream(server, "/v1/chat/completions",
                                                       {**chat, "stop": stop})[:-1]]
    assert "".join(d.get("content", "") for d in deltas) == chat_want


def test_max_completion_tokens_wins_over_max_tokens(server):
    body = greedy(messages=[{"role": "user", "content": "Hi"}], max_tokens=9,
                  max_completion_tokens=3, ignore_eos=True)
    status, out = post(server, "/v1/chat/completions", body)
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 3, out["usage"]


def test_content_parts_and_the_developer_role_are_what_the_template_gets(server):
    def answer(messages):
        status, out = post(server, "/v1/chat/completions", greedy(
            messages=messages, max_tokens=8, ignore_eos=True))
        assert status == 200, out
        return out["choices"][0]["message"]["content"]

    plain = answer([{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hello\nthere"}])
    parts = answer([{"role": "developer", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                 {"type": "text", "text": "there"}]}])
    assert parts == plain, "text parts join with newlines; developer is the system role"
    status, out = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert status == 400 and "image_url" in out["error"]["message"], out


def test_a_list_of_prompts_gives_one_choice_each_in_order(server):
    prompts = ["The cat", "A dog", "Rain"]
    want = [post(server, "/v1/completions", greedy(prompt=p, max_tokens=5, ignore_eos=True))[1]
            ["choices"][0]["text"] for p in prompts]
    status, out = post(server, "/v1/completions", greedy(prompt=prompts, max_tokens=5,
                                                         ignore_eos=True))
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["text"] for c in out["choices"]] == want
    assert out["usage"]["completion_tokens"] == 15
    events = stream(server, "/v1/completions", greedy(prompt=prompts, max_tokens=5,
                                                      ignore_eos=True))
    got = ["", "", ""]
    for e in events[:-1]:
        for c in e["choices"]:
            got[c["index"]] += c["text"]
    assert got == want, "streamed choices, gathered by index, must be the same texts"
    ids = [[300, 301, 302], [400, 401]]
    status, out = post(server, "/v1/completions", greedy(prompt=ids, max_tokens=3))
    assert status == 200 and len(out["choices"]) == 2, out


def test_echo_prepends_the_prompt(server):
    status, out = post(server, "/v1/completions", greedy(prompt="Echo me", max_tokens=4))
    status, echoed = post(server, "/v1/completions", greedy(prompt="Echo me", max_tokens=4,
                                                            echo=True))
    assert status == 200, echoed
    assert echoed["choices"][0]["text"] == "Echo me" + out["choices"][0]["text"]
    events = stream(server, "/v1/completions", greedy(prompt="Echo me", max_tokens=4,
                                                      echo=True))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == echoed["choices"][0]["text"]


def test_a_chat_answer_may_fill_the_context_and_a_completion_keeps_16(server):
    status, out = post(server, "/v1/chat/completions", greedy(
        messages=[{"role": "user", "content": "Write a long story."}], ignore_eos=True))
    assert status == 200, out
    usage = out["usage"]
    assert usage["total_tokens"] == KV_TOKENS and out["choices"][0]["finish_reason"] == "length", (
        f"a chat request without max_tokens may run to the end of the room it has "
        f"({KV_TOKENS} tokens in this pool), not stop at 16: {usage}")
    status, out = post(server, "/v1/completions", greedy(prompt="Hi", ignore_eos=True))
    assert out["usage"]["completion_tokens"] == 16, "a completion keeps OpenAI's default of 16"


# ---------------------------------------------------------------------------------------------
# what is refused, and how


def test_penalties_reach_the_sampler(server):
    """The server's answer with penalties is labkit's own (the same settings through
    `labkit.generate`), and it differs from the answer without them."""
    import labkit
    from labkit.engine import Engine
    from labkit.loading import load_model
    from labkit.sampling import SamplingParams

    body = greedy(prompt="Once upon a time", max_tokens=24, ignore_eos=True)
    pen = {"presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3}
    plain = post(server, "/v1/completions", body)[1]["choices"][0]["text"]
    status, out = post(server, "/v1/completions", {**body, **pen})
    assert status == 200, out
    model, tok = load_model("tiny")
    engine = Engine(model, tok, kv_tokens=KV_TOKENS)
    try:
        want = labkit.generate(["Once upon a time"], SamplingParams(
            max_new_tokens=24, ignore_eos=True, **pen), engine=engine)[0].text
    finally:
        engine.close()
    assert out["choices"][0]["text"] == want
    assert want != plain, "the penalties changed nothing: were they passed on?"


def test_n_answers_per_prompt_are_labkits_samples(server):
    """`n`: choice i * n + j is sample j of prompt i, the same answer `labkit.generate` gives
    for that sample; streamed, every choice's chunks carry its index; the prompt's tokens are
    counted once."""
    import labkit
    from labkit.engine import Engine
    from labkit.loading import load_model
    from labkit.sampling import SamplingParams

    body = {"prompt": ["Once upon a time", "The sky"], "max_tokens": 8, "temperature": 1.0,
            "seed": 5, "n": 3, "ignore_eos": True}
    status, out = post(server, "/v1/completions", body)
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == list(range(6))
    model, tok = load_model("tiny")
    engine = Engine(model, tok, kv_tokens=KV_TOKENS)
    try:
        want = labkit.generate(body["prompt"], SamplingParams(
            max_new_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True), engine=engine)
    finally:
        engine.close()
    assert [c["text"] for c in out["choices"]] == [c.text for c in want]
    assert len({c["text"] for c in out["choices"][:3]}) > 1, "the samples differ"
    n_prompt = sum(len(tok.encode(p)) for p in body["prompt"])
    assert out["usage"]["prompt_tokens"] == n_prompt
    assert out["usage"]["completion_tokens"] == 6 * 8
    events = stream(server, "/v1/completions", {**body, "stream": True})
    texts = [""] * 6
    for e in events:
        for c in (e["choices"] if isinstance(e, dict) else []):  # "[DONE]" last
            texts[c["index"]] += c["text"]
    assert texts == [c.text for c in want]


def test_chat_logprobs_come_with_each_token(server):
    status, out = post(server, "/v1/chat/completions", greedy(
        messages=[{"role": "user", "content": "Hi"}], max_tokens=6, ignore_eos=True,
        logprobs=True, top_logprobs=3))
    assert status == 200, out
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 6
    for t in content:
        top = [a["logprob"] for a in t["top_logprobs"]]
        assert len(top) == 3 and top == sorted(top, reverse=True) and top[0] <= 0
        # greedy, no penalty: the token taken is the most likely one
        assert t["token"] == t["top_logprobs"][0]["token"]
        assert t["logprob"] == pytest.approx(top[0])
        assert t["bytes"] == list(t["token"].encode())
    status, out = post(server, "/v1/chat/completions", greedy(
        messages=[{"role": "user", "content": "Hi"}], max_tokens=2, logprobs=False))
    assert out["choices"][0]["logprobs"] is None


def test_completion_logprobs_stop_where_the_text_stops(server):
    full = post(server, "/v1/completions", greedy(prompt="Once", max_tokens=12,
                                                  ignore_eos=True, logprobs=2))[1]
    lp = full["choices"][0]["logprobs"]
    text = full["choices"][0]["text"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 12
    assert all(len(t) == 2 for t in lp["top_logprobs"])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    # a stop string inside the answer: only the tokens whose text starts before it are listed
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = post(server, "/v1/completions", greedy(prompt="Once", max_tokens=12, ignore_eos=True,
                                                 logprobs=0, stop=stop))[1]["choices"][0]
    assert stop not in cut["text"] and text.startswith(cut["text"])
    offsets = cut["logprobs"]["text_offset"]
    assert offsets and all(o < max(len(cut["text"]), 1) for o in offsets)
    assert len(offsets) < 12 and cut["logprobs"]["top_logprobs"][0] == {}
    assert cut["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(offsets)]


@pytest.mark.parametrize("path, extra, param, words", [
    ("/v1/completions", {"logprobs": 1, "stream": True}, "logprobs", "stream"),
    ("/v1/chat/completions", {"logprobs": True, "stream": True}, "logprobs", "stream"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ("/v1/completions", {"logprobs": -1}, "logprobs", "0"),
    ("/v1/completions", {"presence_penalty": 2.5}, None, "presence_penalty must be"),
    ("/v1/completions", {"repetition_penalty": 0}, None, "repetition_penalty must be"),
])
def test_logprobs_and_penalties_out_of_range_are_a_400_naming_them(server, path, extra, param,
                                                                   words):
    base = ({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path
            else {"prompt": "Hi"})
    status, out = post(server, path, {**base, "max_tokens": 2, **extra})
    assert status == 400, out
    assert words in out["error"]["message"], out
    if param is not None:
        assert param in (out["error"]["param"] or out["error"]["message"]), out


@pytest.mark.parametrize("path, body, words", [
    ("/v1/completions", {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ("/v1/completions", {"prompt": "Hi", "stop": [""]}, "empty"),
    ("/v1/completions", {"prompt": "Hi", "tools": []}, "tools"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "role"),
])
def test_what_is_truly_unsupported_is_a_400_naming_it(server, path, body, words):
    status, out = post(server, path, body)
    assert status == 400 and words in out["error"]["message"], out


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"prompt": "bad \\ud800 text", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": ["fine", "\\ud800"], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'),
])
def test_text_the_tokenizer_cannot_encode_is_a_400(server, path, body):
    status, out = post(server, path, body)
    assert status == 400, f"a lone surrogate (valid JSON) must be the client's error: {out}"
    message = out["error"]["message"]
    assert "surrogate" in message and "Traceback" not in message, message
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200


# ---------------------------------------------------------------------------------------------
# an engine that dies


# the engine thread's traceback is the server log's, raised on purpose here
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_engine_that_dies_answers_every_request_with_a_one_line_5xx(monkeypatch):
    import labkit.serving.worker as worker_mod

    app = tiny_app()
    worker = app.state.worker
    running = threading.Event()

    def dying_run(engine, decoder):
        running.set()
        t0 = time.monotonic()
        while worker._inbox.empty() and time.monotonic() - t0 < 20:  # a second job is queued
            time.sleep(0.01)
        raise RuntimeError("device lost\n  (a second line the client must not see)")

    monkeypatch.setattr(worker_mod, "run", dying_run)
    s = ThreadServer(app)
    answers: dict[str, tuple] = {}

    def ask(name):
        try:
            answers[name] = s.post("/v1/completions", {"prompt": name, "max_tokens": 50})
        except OSError as err:  # a request never answered times out here (30 s)
            answers[name] = (None, repr(err))

    try:
        with deadline(90, "the requests to a server whose engine died"):
            first = threading.Thread(target=ask, args=("running",))
            first.start()
            assert running.wait(30), "the engine never started the first request"
            second = threading.Thread(target=ask, args=("queued",))
            second.start()
            first.join()
            second.join()
            for name, (status, out) in answers.items():
                assert status is not None and 500 <= status < 600, (
                    f"the {name} request got {status}: {out}")
                message = out["error"]["message"]
                assert "device lost" in message and "\n" not in message, (
                    f"the {name} request's message must be one line: {message!r}")
                assert "Traceback" not in json.dumps(out)
            status, health = s.get("/health")
            assert status == 503 and health["status"] == "failed", health
            assert "device lost" in health["error"] and "\n" not in health["error"], health
            status, out = s.post("/v1/completions", {"prompt": "later", "max_tokens": 2})
            assert status == 503 and "device lost" in out["error"]["message"], out
    finally:
        s.close()
        worker.engine.close()


def test_a_request_whose_commit_raises_is_a_one_line_500_and_the_server_serves_on(server):
    """A request that fails inside the engine's commit (a constraint, the detokenizer) gets a
    500 with the error's one line; the next request is answered as usual."""
    engine = server.app.state.worker.engine
    real = engine._stop_reason

    def stop_reason(seq, tok):
        if len(seq.output_ids) == 2:
            raise ValueError("injected fault")
        return real(seq, tok)
    engine._stop_reason = stop_reason
    try:
        status, body = post(server, "/v1/completions", greedy(prompt="Hello", max_tokens=6))
    finally:
        del engine._stop_reason
    assert status == 500, (status, body)
    message = body["error"]["message"]
    assert "ValueError: injected fault" in message and "\n" not in message
    status, body = post(server, "/v1/completions", greedy(prompt="Hello", max_tokens=3))
    assert status == 200, (status, body)
