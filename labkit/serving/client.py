"""A workload replayed over HTTP against any OpenAI-compatible server, timing every token.

The benchmark outlives the engine: `bench serve --url http://host:port` sends the same seeded
Poisson workload that `bench serve` replays in process, to labkit's own server
(`python -m labkit serve`) or to a vLLM, SGLang or TensorRT-LLM server, and reports the same
row. Only the Python standard library speaks HTTP here (`http.client`), so nothing a learner
installs for a production engine can skew the client.

Each request is a streamed `POST /v1/completions` whose prompt is the workload's token ids (the
API accepts a list of ids, so no tokenizer is needed on this side), greedy, with
`ignore_eos: true` (an extension that vLLM, SGLang and labkit share) so that each runs to its
stated length, and `stream_options: {"include_usage": true}` so that the last chunk counts the
tokens. Per request, from its arrival time:

- TTFT: arrival to the first chunk that carries text;
- TPOT: (last chunk - first chunk) / (tokens - 1), tokens from the usage chunk (a chunk may
  carry several tokens: the detokenizer holds back an incomplete character);
- e2e: arrival to the last chunk.

One thread per request, started at its arrival time: a server sees the requests overlap as
real clients would make them.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from labkit.serving.metrics import RequestLatency
from labkit.serving.workload import Request


@dataclass(frozen=True)
class Endpoint:
    """Where an OpenAI-compatible server answers: `http://host:port` (its API under /v1)."""

    host: str
    port: int
    base: str = "/v1"
    https: bool = False

    @staticmethod
    def parse(url: str) -> Endpoint:
        """`http://127.0.0.1:8000`, `http://host:8000/v1` or `https://...` -> an Endpoint."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url must look like http://host:port, got {url!r}")
        path = parts.path.rstrip("/")
        base = path if path.endswith("/v1") else path + "/v1"
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return Endpoint(parts.hostname, port, base, parts.scheme == "https")

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        """A fresh connection (one per request: requests run in parallel)."""
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=timeout)

    def get(self, path: str, timeout: float = 10.0) -> dict:
        """GET `base + path` as JSON; an HTTP error raises RuntimeError with the server's text."""
        conn = self.connect(timeout)
        try:
            conn.request("GET", self.base + path)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {self.base}{path}: HTTP {resp.status}: "
                                   f"{body[:300].decode(errors='replace')}")
            return json.loads(body)
        finally:
            conn.close()

    def model_name(self) -> str:
        """The first model the server lists (`GET /v1/models`)."""
        data = self.get("/models").get("data") or []
        if not data:
            raise RuntimeError(f"{self.host}:{self.port}{self.base}/models lists no model")
        return data[0]["id"]


@dataclass(frozen=True)
class StreamedAnswer:
    """One streamed completion: when each text chunk came (s after sending), and the count."""

    chunk_times_s: tuple[float, ...]
    tokens: int
    text: str


def stream_completion(endpoint: Endpoint, model: str, prompt_ids: Sequence[int],
                      max_tokens: int, timeout: float = 600.0) -> StreamedAnswer:
    """POST one streamed greedy completion and time its chunks (see the module docstring)."""
    body = {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    conn = endpoint.connect(timeout)
    try:
        t0 = time.perf_counter()
        conn.request("POST", endpoint.base + "/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"POST {endpoint.base}/completions: HTTP {resp.status}: "
                               f"{resp.read()[:300].decode(errors='replace')}")
        times, pieces, usage = [], [], None
        for raw in resp:  # server-sent events: "data: {...}" lines, blank lines between
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                raise RuntimeError(f"the server failed a request: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    times.append(time.perf_counter() - t0)
                    pieces.append(choice["text"])
    finally:
        conn.close()
    tokens = usage["completion_tokens"] if usage else len(times)
    return StreamedAnswer(tuple(times), tokens, "".join(pieces))


def latency_of(answer: StreamedAnswer, lag_s: float) -> RequestLatency:
    """Latencies from the arrival: `lag_s` is how late after its arrival it was sent."""
    t, n = answer.chunk_times_s, answer.tokens
    if not t:
        nan = float("nan")
        return RequestLatency(nan, nan, nan, n)
    tpot = (t[-1] - t[0]) / (n - 1) if n > 1 else float("nan")
    return RequestLatency(t[0] + lag_s, tpot, t[-1] + lag_s, n)


def replay(endpoint: Endpoint, requests: Sequence[Request], model: str | None = None,
           timeout: float = 600.0) -> tuple[list[RequestLatency], float]:
    """Send every request at its arrival time, each on its own thread; (latencies in workload
    order, wall seconds from the start to the last answer). A failed request raises."""
    model = model or endpoint.model_name()
    answers: list[StreamedAnswer | None] = [None] * len(requests)
    lags = [0.0] * len(requests)
    errors: list[BaseException] = []
    start = time.perf_counter()

    def one(i: int, r: Request) -> None:
        try:
            lags[i] = max(0.0, time.perf_counter() - start - r.arrival_s)
            answers[i] = stream_completion(endpoint, model, r.prompt_ids, r.max_new_tokens,
                                           timeout)
        except BaseException as err:  # noqa: BLE001 - reported by the caller's thread
            errors.append(err)

    threads = []
    for i, r in enumerate(requests):
        wait = r.arrival_s - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        th = threading.Thread(target=one, args=(i, r), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(requests)} requests failed; the first: "
                           f"{errors[0]}")
    return [latency_of(a, lag) for a, lag in zip(answers, lags)], wall
