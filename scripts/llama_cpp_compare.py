"""One stream, side by side: labkit against llama.cpp on the same GGUF file (issue: "the whole
engine is the fastest engine"). Not a course requirement: llama.cpp runs from a separate venv
with llama-cpp-python installed (`python -m venv /tmp/llv && /tmp/llv/bin/pip install
llama-cpp-python`), as a worker process this script drives; labkit runs here.

    .venv/bin/python scripts/llama_cpp_compare.py --llama-python /tmp/llv/bin/python

Both decode the same chat prompt's token ids, greedily, 128 new tokens (EOS banned on both
sides), with 2 threads, in alternating turns (the order swaps each round); a turn's figure is
its decode rate, (new tokens - 1) / (time of the last token - time of the first), and its time
to first token. Prints one JSON line per engine with the medians, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PROMPT = "Explain in a few sentences how a refrigerator keeps food cold."

WORKER = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, eos = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024,
            verbose=False)
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    llm.reset()
    t0 = time.perf_counter()
    stamps = []
    for chunk in llm.create_completion(req["ids"], max_tokens=req["n"], temperature=0.0,
                                       top_k=1, stream=True, logit_bias={eos: -1e9}):
        if chunk["choices"][0]["finish_reason"] is None:  # the last chunk only says why
            stamps.append(time.perf_counter())
    print(json.dumps({"t0": t0, "stamps": stamps}), flush=True)
"""


def rates(t0: float, stamps: list[float], tokens: int) -> tuple[float, float]:
    """(decode tokens/s, time to first token s) of one turn of `tokens` new tokens whose
    first and last arrived at stamps[0] and stamps[-1]."""
    return (tokens - 1) / (stamps[-1] - stamps[0]), stamps[0] - t0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python")
    p.add_argument("--quant", default="int4,int8,none", help="labkit's weights to compare")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    import torch

    from labkit import generate
    from labkit.engine import Engine
    from labkit.loading import load_model
    from labkit.sampling import SamplingParams
    from labkit.utils.cache import packaged_gguf

    torch.set_num_threads(args.threads)
    _, tok = load_model("smollm2-135m")
    ids = tok.encode(PROMPT, chat=True)
    worker = subprocess.Popen([args.llama_python, "-c", WORKER, str(packaged_gguf()),
                               str(args.threads), str(tok.eos_id)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "ready"

    def llama_turn() -> tuple[float, float]:
        worker.stdin.write(json.dumps({"ids": ids, "n": args.tokens}) + "\n")
        worker.stdin.flush()
        out = json.loads(worker.stdout.readline())
        assert len(out["stamps"]) == args.tokens, len(out["stamps"])
        return rates(out["t0"], out["stamps"], args.tokens)

    engines = {}
    for q in args.quant.split(","):
        model, _ = load_model("smollm2-135m", quant=None if q == "none" else q, fuse=True)
        engines[q] = Engine(model, tok, max_seqs=1, kv_tokens=1024)

    def labkit_turn(engine) -> tuple[float, float]:
        stamps = []
        t0 = time.perf_counter()
        generate(ids, SamplingParams(max_new_tokens=args.tokens, ignore_eos=True), engine=engine,
                 on_text=lambda i, text: stamps.append(time.perf_counter()))
        # on_text fires per detokenized piece: the first and the last token's arrivals
        return rates(t0, stamps, args.tokens)

    turns = {"llama.cpp": [], **{f"labkit {q}": [] for q in engines}}
    fns = {"llama.cpp": llama_turn, **{f"labkit {q}": (lambda e=e: labkit_turn(e))
                                       for q, e in engines.items()}}
    for fn in fns.values():
        fn()  # warm-up
    names = list(fns)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            turns[name].append(fns[name]())
    worker.stdin.close()
    worker.wait(30)
    base = statistics.median(t[0] for t in turns["llama.cpp"])
    for name, got in turns.items():
        tps = statistics.median(t[0] for t in got)
        print(json.dumps({"engine": name, "decode_tok_s": round(tps, 1),
                          "ttft_ms": round(statistics.median(t[1] for t in got) * 1e3, 1),
                          "over_llama_cpp": round(tps / base, 3), "threads": args.threads,
                          "tokens": args.tokens, "rounds": args.rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
