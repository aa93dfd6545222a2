"""The whole engine served: `python -m labkit serve` with every feature's flag, spoken to over
HTTP, and `bench serve --url` sending its seeded workload to that real server."""

from __future__ import annotations

import json

import pytest

from tests.test_server import Server

pytest.importorskip("fastapi")

FLAGS = ("--model", "tiny", "--quant", "int8", "--attention", "flash", "--decoder", "pipelined",
         "--max-step-tokens", "16", "--batching", "continuous", "--kv-tokens", "4096")


@pytest.fixture(scope="module")
def whole_server():
    server = Server(*FLAGS)
    yield server
    server.close()


def test_the_whole_engine_serves_labkit_generates_text(whole_server):
    import labkit
    from labkit.engine import Engine
    from labkit.loading import load_model

    prompt = "The capital of France is a city that"
    ids = list(range(300, 340))  # 40 ids: three chunks under the 16-token budget
    status, body = whole_server.post("/v1/completions", {
        "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    model, tok = load_model("tiny", quant="int8")
    plain = Engine(model, tok, max_step_tokens=None, batching="static", kv_reserve="max",
                   prefix_caching=False, attention="naive")
    want = labkit.generate([ids], labkit.SamplingParams(max_new_tokens=12, ignore_eos=True),
                           engine=plain)[0]
    plain.close()
    assert body["choices"][0]["text"] == want.text, (
        "the whole engine over HTTP must give the plain engine's greedy text")
    assert body["usage"]["completion_tokens"] == 12
    events = whole_server.stream("/v1/completions", {
        "prompt": prompt, "max_tokens": 6, "temperature": 0,
        "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] <= 6


@pytest.mark.parametrize("argv, words", [
    (["--max-step-tokens", "0"], "--max-step-tokens must be >= 1"),
    (["--max-step-tokens", "lots"], "--max-step-tokens must be an integer"),
    (["--quant", "int3"], "--quant"),
    (["--batching", "dynamic"], "--batching"),
    (["--attention", "sdpa"], "--attention"),
])
def test_bad_engine_flags_exit_2_before_loading(argv, words, capsys, monkeypatch):
    import labkit.loading
    from labkit.serving.server import serve_main

    monkeypatch.setattr(labkit.loading, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as info:
        serve_main(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_bench_serve_url_sends_the_workload_to_a_real_server(whole_server, capsys):
    from labkit.bench import serve as bench_serve
    from labkit.serving.client import Endpoint, replay
    from labkit.serving.workload import poisson_workload

    url = f"http://127.0.0.1:{whole_server.port}"
    rc = bench_serve.main(["--url", url, "--model", "tiny", "--rate", "40", "--requests", "4",
                           "--short", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    (row,) = [json.loads(line) for line in out.out.splitlines()]
    assert row["batching"] == "url" and row["url"] == url and row["model"] == "tiny"
    assert row["throughput_tok_s"] > 0 and row["ttft_p50_ms"] <= row["ttft_p99_ms"]
    assert 0 <= row["goodput"] <= 1
    # each request ran to its stated length: the usage chunk counts them
    work = poisson_workload(3, 40, seed=1, vocab_size=8192,
                            prompt=bench_serve.SHORT_PROMPTS, output=bench_serve.SHORT_OUTPUTS)
    lat, wall = replay(Endpoint.parse(url + "/v1"), work)
    assert [r.tokens for r in lat] == [r.max_new_tokens for r in work]
    assert all(r.ttft_s <= r.e2e_s for r in lat) and wall > 0


@pytest.mark.parametrize("argv, words", [
    (["--url", "ftp://x"], "--url must look like http://host:port"),
    (["--url", "http://127.0.0.1:9", "--model", "/some/path"], "give --vocab-size"),
])
def test_bench_serve_url_checks_its_arguments(argv, words, capsys):
    from labkit.bench import serve as bench_serve

    with pytest.raises(SystemExit) as info:
        bench_serve.main(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err
