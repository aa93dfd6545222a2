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

KEYS = {"index", "sample", "prompt_ids", "output_ids", "text", "finish_reason"}


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
def test_a_bare_question_to_the_instruct_model_says_to_use_chat():
    # SmolLM2-Instruct ends a bare question at once: a first run must not end in silence
    bare = labkit("generate", "--max-new-tokens", "8", "Why is the sky blue?")
    assert bare.returncode == 0, bare.stderr
    assert "ended at once" in bare.stderr and "--chat" in bare.stderr
    chat = labkit("generate", "--chat", "--max-new-tokens", "8", "Why is the sky blue?")
    assert chat.returncode == 0 and chat.stdout.strip()  # an answer, and no hint
    assert "ended at once" not in chat.stderr


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
    "max-step-tokens-0": (["--model", "tiny", "--max-step-tokens", "0", "a b c"],
                          "--max-step-tokens must be >= 1"),
    "kv-tokens-0": (["--model", "tiny", "--kv-tokens", "0", "a b c"], "--kv-tokens must be >= 1"),
    "kv-pool-too-small": (["--model", "tiny", "--kv-tokens", "32", "a b c"],
                          "it could never run"),
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
    # a flag's value error names the flag the user typed, not "argument 1"
    "flag-max-new": (["--model", "tiny", "--max-new-tokens", "0", "a b c"],
                     "--max-new-tokens: max_new_tokens must be"),
    "flag-top-p": (["--model", "tiny", "--top-p", "2", "a b c"], "--top-p: top_p must be"),
    "flag-top-k": (["--model", "tiny", "--top-k", "0", "a b c"], "--top-k: top_k must be"),
    "jsonl-constraint-kind": (
        ["--model", "tiny", "--prompts-file",
         'FILE:{"prompt": "a"}\n{"prompt": "b", "constraint": {"circle": 1}}'],
        "bad.jsonl:2: constraint: unknown constraint kind 'circle'"),
    "jsonl-empty": (["--model", "tiny", "--prompts-file", "FILE:\n  \n"], "bad.jsonl is empty"),
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


def test_info_prints_versions_threads_device_and_cache(monkeypatch, capsys):
    from labkit.cli import info_main

    monkeypatch.setenv("LABKIT_HUGE_PAGES", "0")
    assert info_main([]) == 0
    assert "weight pages  4 KiB as loaded (LABKIT_HUGE_PAGES=0)" in capsys.readouterr().out
    monkeypatch.delenv("LABKIT_HUGE_PAGES")
    proc = labkit("info")
    assert proc.returncode == 0, proc.stderr
    for field in ("labkit", "python", "torch", "transformers", "threads", "device",
                  "model package", "model cache", "weight pages"):
        assert any(line.startswith(field) for line in proc.stdout.splitlines()), field


def test_no_command_prints_usage_and_unknown_command_exits_2():
    proc = labkit()
    assert proc.returncode == 0 and "usage: python -m labkit COMMAND" in proc.stdout
    for name in ("generate", "info", "bench"):
        assert name in proc.stdout
    proc = labkit("frobnicate")
    assert proc.returncode == 2
    assert "unknown command 'frobnicate'" in proc.stderr and proc.stdout == ""


def test_flag_errors_never_say_argument_1(tmp_path, capsys):
    from labkit.__main__ import main

    for flag, value in (("--max-new-tokens", "0"), ("--top-p", "0"), ("--top-k", "-1"),
                        ("--temperature", "-1")):
        assert main(["generate", "--model", "tiny", flag, value, "a b c"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flag}: ") and "argument 1" not in err, err


def exit_code(run, argv: list[str]) -> int:
    """A command's exit code, in this process: argparse exits, roofline returns its code."""
    try:
        return run(argv)
    except SystemExit as exit_:
        return exit_.code


def test_prefix_of_an_option_is_rejected_not_guessed(capsys):
    """argparse's prefix matching would read --max-new-token as --max-new-tokens."""
    from labkit.__main__ import main
    from labkit.bench import decode as bench_decode

    for run, argv in ((main, ["generate", "--max-new-token", "5", "a"]),
                      (main, ["roofline", "--hard", "H100"]),
                      (main, ["bench", "generate", "--stream", "4"]),
                      (bench_decode.main, ["--stream", "1"])):
        assert exit_code(run, argv) == 2, argv
        assert "unrecognized arguments: --" in capsys.readouterr().err, argv


@pytest.mark.parametrize("extra", [["--foo"], ["extra"]])
def test_info_rejects_arguments(capsys, extra):
    from labkit.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["info", *extra])
    assert exit_.value.code == 2
    assert f"unrecognized arguments: {extra[0]}" in capsys.readouterr().err


@pytest.mark.parametrize("command, shown", [
    (["generate"], ["(default: 64)", "(default: 1.0)", "(default: smollm2-135m)",
                    "(default: blocking)"]),
    (["roofline"], ["(default: H200)", "(default: 1,8,32,256)", "(default: 1024)"]),
    (["bench", "generate"], ["(default: 32)", "(default: 1)"]),
    (["bench", "decode"], ["(default: 1,32)", "(default: 110)", "(default: 12)",
                           "(default: auto)"]),
])
def test_help_shows_the_defaults(capsys, command, shown):
    from labkit.__main__ import main

    assert exit_code(main, [*command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    for text in shown:
        assert text in out, (text, out)
    assert "(default: None)" not in out and "(default: False)" not in out


def test_example_requests_file_covers_every_setting_and_runs():
    """examples/requests.jsonl, as the README shows it: every per-line key, all three kinds of
    constraint, and each answer obeys its line (tiny model: random words, but valid ones)."""
    from labkit.cli import JSONL_KEYS

    path = "examples/requests.jsonl"
    lines = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    assert set().union(*lines) == JSONL_KEYS, "every per-line setting appears in the example"
    kinds = [next(iter(x["constraint"])) for x in lines if "constraint" in x]
    assert sorted(kinds) == ["box", "choice", "point"]
    proc = labkit("generate", "--model", "tiny", "--json", "--max-new-tokens", "6",
                  "--prompts-file", path)
    outs = json_lines(proc)
    assert [(o["index"], o["sample"]) for o in outs] == [
        (i, j) for i, line in enumerate(lines) for j in range(line.get("n", 1))]
    for o in outs:
        line = lines[o["index"]]
        spec = line.get("constraint")
        if spec is None:
            assert len(o["output_ids"]) <= line.get("max_new_tokens", 6), (line, o)
            continue
        assert o["finish_reason"] == "stop", ("a constrained answer ends complete", line, o)
        if "choice" in spec:
            assert o["text"] in spec["choice"], o
        else:
            answer = json.loads(o["text"])
            keys = {"x", "y"} if "point" in spec else {"x_min", "y_min", "x_max", "y_max"}
            assert set(answer) == keys and all(0 <= v <= 1 for v in answer.values()), o


def test_readme_shows_the_example_requests_file_as_it_is():
    readme = open("README.md", encoding="utf-8").read()
    shown = readme.split("```json\n", 1)[1].split("```", 1)[0]
    assert shown == open("examples/requests.jsonl", encoding="utf-8").read(), (
        "README.md's prompts-file example differs from examples/requests.jsonl: copy it over")


def test_flash_attention_backend_gives_the_same_tokens():
    args = ("generate", "--model", "tiny", "--json", "--max-new-tokens", "6", "a b c",
            "The cat sat on the mat")
    paged = json_lines(labkit(*args))
    flash = json_lines(labkit(*args, "--attention", "flash"))
    assert [o["output_ids"] for o in flash] == [o["output_ids"] for o in paged]


def test_generate_n_draws_n_answers_sharing_the_prompt():
    proc = labkit("generate", "--model", "tiny", "--json", "--n", "3", "--temperature", "1",
                  "--max-new-tokens", "5", "Tell me a story")
    outs = json_lines(proc)
    assert [(o["index"], o["sample"]) for o in outs] == [(0, 0), (0, 1), (0, 2)]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1, "each answer has its own seed"
    assert "KV pages shared" in proc.stderr
    bad = labkit("generate", "--model", "tiny", "--n", "0", "hi")
    assert bad.returncode == 2 and "--n: n must be an integer in [1, 128]" in bad.stderr


def test_top_level_help_lists_every_benchmark(capsys):
    from labkit.__main__ import main
    from labkit.bench.cli import SUBCOMMANDS

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    missing = [name for name in SUBCOMMANDS if f"    {name} " not in out]
    assert not missing, f"`python -m labkit --help` does not list bench {missing}:\n{out}"


class _Parsed(Exception):
    """Raised in place of parsing, carrying the parser a command built."""


EVERY_COMMAND = [["generate"], ["roofline"], ["serve"], ["grade"], ["eval", "ppl"],
                 *(["bench", name] for name in
                   ("generate", "decode", "serve", "paged", "step", "quant", "ablation",
                    "attention"))]


@pytest.mark.parametrize("command", EVERY_COMMAND, ids=" ".join)
def test_every_option_with_a_default_shows_it_in_help(monkeypatch, command):
    """Each command's parser, caught as it parses: every option that has a default says it."""
    import argparse

    from labkit.__main__ import main
    from labkit.cli_parser import _DefaultsFormatter

    def catch(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Parsed) as info:
        main([*command, "--help"])
    parser = info.value.args[0]
    assert parser.formatter_class is _DefaultsFormatter and not parser.allow_abbrev, command
    text = "".join(parser.format_help().split())  # argparse wraps lines anywhere
    for action in parser._actions:
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            continue
        help_ = parser.formatter_class("x")._expand_help(action)
        assert "default" in help_ and "".join(help_.split()) in text, (command, action.dest)
    assert "(default:None)" not in text and "(default:False)" not in text
    assert "(default:[" not in text, text  # a list default as it is typed: 2,8
