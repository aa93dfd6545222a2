"""`python -m labkit serve`: a real server on 127.0.0.1, spoken to over HTTP, streaming included."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.deadline import deadline

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `python -m labkit serve` subprocess and a tiny HTTP client for it."""

    def __init__(self, *args: str):
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "labkit", "serve", "--port", str(self.port), *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("server did not answer /health within 120 s")

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def get(self, path: str) -> tuple[int, dict]:
        c = self.conn()
        c.request("GET", path)
        r = c.getresponse()
        return r.status, json.loads(r.read())

    def post(self, path: str, body) -> tuple[int, dict]:
        c = self.conn()
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        c.request("POST", path, data, {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())

    def stream(self, path: str, body: dict) -> list:
        """The parsed `data:` events of a streamed answer, up to and including "[DONE]"."""
        c = self.conn()
        c.request("POST", path, json.dumps({**body, "stream": True}).encode(),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
        events = []
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def smollm2_server():
    server = Server("--model", "smollm2-135m", "--decoder", "pipelined")
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference():
    """labkit.generate on the same model, greedy: what the server must return."""
    import labkit

    def ref(prompt: str, n: int, chat: bool = False) -> str:
        out = labkit.generate([prompt], labkit.SamplingParams(max_new_tokens=n), chat=chat)
        return out[0].text

    return ref


def test_health_and_models(smollm2_server):
    status, health = smollm2_server.get("/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == "smollm2-135m"
    status, models = smollm2_server.get("/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["smollm2-135m"]


def test_completion_equals_labkit_generate(smollm2_server, reference):
    prompt = "The capital of France is"
    status, body = smollm2_server.post("/v1/completions", {
        "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == reference(prompt, 12), "server text differs from labkit.generate"
    assert body["object"] == "text_completion" and choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 12


def test_streamed_completion_concatenates_to_the_same_text(smollm2_server, reference):
    prompt = "Once upon a time"
    events = smollm2_server.stream("/v1/completions", {
        "prompt": prompt, "max_tokens": 10, "temperature": 0})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2, "a streamed answer arrives in pieces"
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference(prompt, 10)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_completion_plain_and_streamed(smollm2_server, reference):
    question = "Name a prime number."
    want = reference(question, 12, chat=True)
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 12,
            "temperature": 0}
    status, out = smollm2_server.post("/v1/chat/completions", body)
    assert status == 200, out
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": want}
    events = smollm2_server.stream("/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == want


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 4}, "prompt"),  # no prompt
    ({"prompt": "hi", "n": 0}, "n"),  # at least one answer
    ({"prompt": "hi", "n": 129}, "n"),  # at most 128, as OpenAI
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "frobnicate": True}, "frobnicate"),  # unknown fields are refused
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "max_tokens": 100000}, "context"),  # longer than the model's context
    (b"{not json", "JSON"),
])
def test_bad_body_is_a_400_and_the_server_keeps_serving(smollm2_server, body, field):
    status, out = smollm2_server.post("/v1/completions", body)
    assert status == 400, out
    err = out["error"]
    assert err["type"] == "invalid_request_error" and field in err["message"] + str(err["param"])
    status, ok = smollm2_server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                                         "temperature": 0})
    assert status == 200 and ok["choices"][0]["text"] is not None


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_request(stream):
    server = Server("--model", "tiny", "--decoder", "pipelined")
    try:
        with deadline(90, "a disconnected client's request"):
            c = server.conn()
            c.request("POST", "/v1/completions", json.dumps({
                "prompt": "count forever", "max_tokens": 1000, "temperature": 0,
                "ignore_eos": True, "stream": stream}).encode(),
                {"Content-Type": "application/json"})
            if stream:
                r = c.getresponse()
                assert r.status == 200
                r.fp.readline()  # the first event: the request is running
            else:  # tokens flow all along: the server is never idle for long
                while server.get("/health")[1]["running"] != 1:
                    time.sleep(0.02)
                time.sleep(0.3)
            assert server.get("/health")[1]["running"] == 1
            c.sock.shutdown(socket.SHUT_RDWR)
            c.close()
            t0 = time.monotonic()
            while server.get("/health")[1]["running"] and time.monotonic() - t0 < 30:
                time.sleep(0.1)
            health = server.get("/health")[1]
        assert health["running"] == 0 and health["waiting"] == 0, (
            f"a disconnected client's request still runs 30 s later: {health}")
        assert health["finished"]["cancelled"] == 1, (
            f"the request ended, but not because its client left: {health['finished']}")
        assert time.monotonic() - t0 < 5, "the request was cancelled, but late"
    finally:
        server.close()


def read_answer(sock: socket.socket) -> tuple[int, str]:
    """(status, body) of the one HTTP/1.1 answer on a raw socket (read until it closes)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def test_sigterm_ends_the_server_and_answers_what_is_in_flight():
    server = Server("--model", "tiny", "--decoder", "pipelined")
    try:
        with deadline(90, "a SIGTERM'd server"):
            long = {"prompt": "count forever", "max_tokens": 1000, "temperature": 0,
                    "ignore_eos": True}
            streamed = server.conn()
            streamed.request("POST", "/v1/completions", json.dumps(
                {**long, "stream": True}).encode(), {"Content-Type": "application/json"})
            stream_answer = streamed.getresponse()
            stream_answer.fp.readline()  # running
            plain = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            body = json.dumps(long).encode()
            plain.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            while server.get("/health")[1]["running"] != 2:
                time.sleep(0.02)
            stalled = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                            b"Content-Type: application/json\r\n"
                            b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # ... and stalls
            time.sleep(0.3)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            try:
                rc = server.proc.wait(20)
            except subprocess.TimeoutExpired:
                pytest.fail("the server did not exit within 20 s of SIGTERM")
            took = time.monotonic() - t0
            status, text = read_answer(plain)
            raw = stream_answer.fp.read().decode()  # chunked: size lines, then the events
            events = [line[len("data: "):] for line in raw.splitlines()
                      if line.startswith("data: ")]
        assert rc == 0, f"exit code {rc}: {server.proc.stderr.read()}"
        assert took < 15, f"SIGTERM took {took:.1f} s to end the server"
        assert status == 503 and "shutting down" in json.loads(text)["error"]["message"], (
            f"a request in flight at SIGTERM must be answered: {status} {text}")
        assert events[-1] == "[DONE]" and "shutting down" in events[-2], (
            f"a stream in flight at SIGTERM must end with an error event: {events[-3:]}")
    finally:
        server.close()


def test_a_port_in_use_is_a_one_line_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with deadline(120, "serve on a port in use"):
            done = subprocess.run([sys.executable, "-m", "labkit", "serve", "--model", "tiny",
                                   "--port", str(port)], capture_output=True, text=True,
                                  timeout=100)
    err = done.stderr.strip()
    assert done.returncode != 0, "a server that cannot listen must exit non-zero"
    assert len(err.splitlines()) == 1 and "in use" in err and str(port) in err, (
        f"want one line that names the port in use, got: {err!r}")
    assert "serving" not in err, "the banner says 'serving' before the port is bound"
