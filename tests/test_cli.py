"""`python -m labkit ...` as a user runs it: a subprocess, its stdout, stderr and exit code.

Most runs use `--model tiny` (random weights, SmolLM2's tokenizer cut to its first 8192 ids, so
the prompts here use only common words); one run uses the real SmolLM2 where the answer must
make sense. Every bad-input case also runs in this process through the same `main`, which
checks the messages without paying a second of interpreter and torch start-up per case.
"""

import json
import subprocess
import sys

import pytest

KEYS = {"index", "prompt_ids", "output_ids", "text", "finish_reason"}


def labkit(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m labkit ARGS...` and capture its output."""
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True,
                          text=True, timeout=timeout)


def json_lines(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's tokenizer (tiny's folds ids past its 8192 into range)."""
    from labkit.tokenizer import smollm2_tokenizer

    return smollm2_tokenizer()


def test_json_gives_one_object_per_request_in_input_order(tok):
    prompts = ["The cat sat on the mat", "a b c", "one two three"]
    proc = labkit("generate", "--model", "tiny", "--json", "--max-new-tokens", "5", *prompts)
    outs = json_lines(proc)
    assert [o["index"] for o in outs] == [0, 1, 2]
    for o, p in zip(outs, prompts):
        assert set(o) == KEYS
        assert o["prompt_ids"] == tok.encode(p)
        assert 1 <= len(o["output_ids"]) <= 5 and o["finish_reason"] in ("stop", "length")
        assert o["text"] == tok.decode(o["output_ids"])
    assert "[labkit] 3 requests" in proc.stderr and "tok/s" in proc.stderr  # stats: stderr


def test_without_json_a_single_prompt_streams_its_text(tok):
    proc = labkit("generate", "--model", "tiny", "--max-new-tokens", "4", "The sky is blue")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and "[labkit] 1 requests" in proc.stderr


def test_prompts_file_with_per_line_settings(tmp_path, tok):
    lines = [{"prompt": "a b c", "max_new_tokens": 3},
             {"prompt": "the first time", "max_new_tokens": 7, "temperature": 1.0, "seed": 5},
             {"prompt": "the first time", "max_new_tokens": 7, "temperature": 1.0, "seed": 5},
             {"prompt": "the first time", "max_new_tokens": 7, "temperature": 1.0, "seed": 6},
             {"prompt": "the first time", "max_new_tokens": 7, "top_k": 1}]
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n"  # blank lines are skipped
                 + "\n".join(json.dumps(x) for x in lines[2:]) + "\n")
    outs = json_lines(labkit("generate", "--model", "tiny", "--json", "--prompts-file", str(f),
                             "--max-new-tokens", "2", "It is a good day"))
    # PROMPT arguments come first, then the file's lines; the flag is the default of each line
    assert [o["index"] for o in outs] == list(range(6))
    assert outs[0]["prompt_ids"] == tok.encode("It is a good day") and len(
        outs[0]["output_ids"]) <= 2
    for o, line in zip(outs[1:], lines):
        assert o["prompt_ids"] == tok.encode(line["prompt"])
        assert len(o["output_ids"]) == line["max_new_tokens"] or o["finish_reason"] == "stop"
    seed5, seed5_again, seed6 = (outs[i]["output_ids"] for i in (2, 3, 4))
    assert seed5 == seed5_again, "the same seed must give the same sample"
    assert seed5 != seed6, "another seed should sample other tokens from a random model"


def test_greedy_by_default_so_the_same_output_twice_whatever_the_seed():
    args = ["generate", "--model", "tiny", "--json", "--max-new-tokens", "8",
            "The cat sat on the mat", "This is the end"]
    first = json_lines(labkit(*args))
    again = json_lines(labkit(*args, "--seed", "12345"))  # greedy ignores the seed
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]


@pytest.mark.slow
def test_chat_on_the_real_model(tmp_path, tok):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "The capital of France is", "chat": False,
                             "max_new_tokens": 4}) + "\n")
    question = "What is the capital of France? Answer in one word."
    outs = json_lines(labkit("generate", "--chat", "--json", "--max-new-tokens", "8",
                             "--prompts-file", str(f), question))
    assert outs[0]["prompt_ids"] == tok.encode(question, chat=True)  # --chat: the template
    assert "Paris" in outs[0]["text"], outs[0]
    assert outs[1]["prompt_ids"] == tok.encode("The capital of France is")  # per-line override


# (arguments, what stderr must say); "FILE:<text>" stands for a prompts file holding <text>
BAD_INPUT = {
    "empty": (["--model", "tiny", ""], "empty prompt"),
    "blank": (["--model", "tiny", "   "], "empty prompt"),
    "too-long": (["--model", "tiny", "a " * 1100], "does not fit the model's context"),
    "max-new-0": (["--model", "tiny", "--max-new-tokens", "0", "a b c"], "max_new_tokens"),
    "temperature-neg": (["--model", "tiny", "--temperature", "-1", "a b c"], "temperature"),
    "top-p-0": (["--model", "tiny", "--top-p", "0", "a b c"], "top_p must be in (0, 1]"),
    "top-p-1.5": (["--model", "tiny", "--top-p", "1.5", "a b c"], "top_p must be in (0, 1]"),
    # regressions: settings that broke on the device (or ran with exit 0 and garbage)
    "temperature-inf": (["--model", "tiny", "--temperature", "inf", "a b c"],
                        "not a finite float32"),
    "temperature-1e39": (["--model", "tiny", "--temperature", "1e39", "a b c"],
                         "not a finite float32"),
    "temperature-1e-40": (["--model", "tiny", "--temperature", "1e-40", "a b c"], "below 1e-06"),
    "top-p-1e-46": (["--model", "tiny", "--top-p", "1e-46", "a b c"], "rounds to 0 in float32"),
    "jsonl-seed-float": (["--model", "tiny", "--prompts-file", 'FILE:{"prompt": "a", "seed": 1.5}'],
                         "bad.jsonl:1: seed must be in [0, 2**63) and an integer, got 1.5"),
    "jsonl-seed-true": (["--model", "tiny", "--prompts-file", 'FILE:{"prompt": "a", "seed": true}'],
                        "bad.jsonl:1: seed must be in [0, 2**63) and an integer, got True"),
    "jsonl-top-k-true": (["--model", "tiny", "--prompts-file",
                          'FILE:{"prompt": "a", "top_k": true}'], "bad.jsonl:1: top_k must be"),
    "constraint-cannot-finish": (["--model", "tiny", "--prompts-file", 'FILE:{"prompt": "'
                                  + "a " * 1000 + '", "constraint": {"box": {"min": 0, '
                                  '"max": 1, "decimals": 3}}}'], "could not finish"),
    "constraint-decimals": (["--model", "tiny", "--prompts-file",
                             'FILE:{"prompt": "a", "constraint": {"point": {"min": 0, "max": 1, '
                             '"decimals": 1000000}}}'], "at most 60 are computed exactly"),
    "unknown-model": (["--model", "no-such-model", "a b c"], "unknown model 'no-such-model'"),
    "jsonl-unknown-key": (["--model", "tiny", "--prompts-file",
                           'FILE:{"prompt": "a", "tmperature": 1}'],
                          "bad.jsonl:1: unknown keys ['tmperature']"),
    "jsonl-invalid": (["--model", "tiny", "--prompts-file", 'FILE:{"prompt": "a"}\n{prompt: b}'],
                      "bad.jsonl:2: not valid JSON"),
}


def _files(args: list[str], tmp_path) -> list[str]:
    """The arguments with each "FILE:<text>" written to a prompts file."""
    out = []
    for a in args:
        if a.startswith("FILE:"):
            a, text = str(tmp_path / "bad.jsonl"), a[5:]
            (tmp_path / "bad.jsonl").write_text(text)
        out.append(a)
    return out


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_exits_2_with_a_message_and_no_output(tmp_path, capsys, name):
    """Every case, in this process (the same `main` as the command, minus its startup)."""
    from labkit.__main__ import main

    args, message = BAD_INPUT[name]
    assert main(["generate", *_files(args, tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert message in err and out == "", (out, err)
    assert len(err.strip().splitlines()) == 1, err  # one line, no traceback


def test_bad_input_as_a_real_process(tmp_path):
    """A few cases end to end: exit code, stderr, an empty stdout, no traceback."""
    names = ["empty", "top-p-1.5", "jsonl-unknown-key"]
    procs = {name: subprocess.Popen(  # at once: each costs seconds of imports, not of work
        [sys.executable, "-m", "labkit", "generate", *_files(BAD_INPUT[name][0], tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in names}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 2, (name, proc.returncode, err)
        assert BAD_INPUT[name][1] in err and "Traceback" not in err, (name, err)
        assert out == "", name


def test_info_prints_versions_threads_device_and_cache():
    proc = labkit("info")
    assert proc.returncode == 0, proc.stderr
    for field in ("labkit", "python", "torch", "transformers", "threads", "device",
                  "model package", "model cache"):
        assert any(line.startswith(field) for line in proc.stdout.splitlines()), field


def test_no_command_prints_usage_and_unknown_command_exits_2():
    proc = labkit()
    assert proc.returncode == 0 and "usage: python -m labkit COMMAND" in proc.stdout
    for name in ("generate", "info", "bench"):
        assert name in proc.stdout
    proc = labkit("frobnicate")
    assert proc.returncode == 2
    assert "unknown command 'frobnicate'" in proc.stderr and proc.stdout == ""
