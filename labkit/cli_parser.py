"""The argument parser every `python -m labkit ...` command builds its options with.

Two habits of argparse surprise a newcomer, so every command turns them off in one place:

- prefix matching: by default `--max-new-token 5` silently means `--max-new-tokens 5`, and a
  later option that shares the prefix changes what an old command line means
  (`allow_abbrev=False`);
- silent defaults: `--help` lists options without the values they take when left out (each
  option's help ends with `(default: ...)`, unless it has no default or says it itself).
"""

from __future__ import annotations

import argparse


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help, unless X is None or False or the help
    already speaks of its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or (
                "default" in text):
            return text
        if isinstance(default, (list, tuple)):  # as it is typed: --rate 2,8, not [2.0, 8.0]
            return f"{text} (default: {','.join(str(x) for x in default)})"
        return super()._get_help_string(action) or ""


def command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An ArgumentParser with no prefix matching, whose --help shows every default."""
    return argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False,
                                   formatter_class=_DefaultsFormatter)


# ---------------------------------------------------------------------------------------------
# the engine's flags, declared once for every command that builds an engine

ATTENTIONS = ("naive", "paged", "flash")  # labkit.attention.BACKENDS, without importing torch
DECODERS = ("blocking", "pipelined")  # labkit.decoders.DECODERS


def add_engine_flags(p: argparse.ArgumentParser, *, decoder: str | None = "blocking",
                     batching: bool = True, kv_tokens: int | str = 16384,
                     budget_may_be_none: bool = False,
                     model_help: str = "smollm2-135m, tiny, or a path") -> None:
    """--model, --decoder, --attention, --kv-tokens, --max-step-tokens, --batching, --quant.

    A command that differs says so: `decoder` is the default decode loop (None: no --decoder,
    the command picks its loops itself); `batching=False` leaves out --batching; `kv_tokens` is
    the pool's default size, or the words that say what the command picks when it is left out
    (then its value is None); `budget_may_be_none` lets --max-step-tokens take 'none' (no
    budget). The values are checked by `engine_kwargs`, so that an error names its flag.
    """
    p.add_argument("--model", default="smollm2-135m", help=model_help)
    if decoder is not None:
        p.add_argument("--decoder", choices=DECODERS, default=decoder, help="the decode loop")
    p.add_argument("--attention", choices=ATTENTIONS, default="paged",
                   help="attention backend (labkit.attention.BACKENDS)")
    pool = "KV pool size in tokens; a small pool forces preemption"
    if isinstance(kv_tokens, int):
        p.add_argument("--kv-tokens", type=int, default=kv_tokens, help=pool)
    else:
        p.add_argument("--kv-tokens", type=int, default=None,
                       help=f"{pool} (default: {kv_tokens})")
    if budget_may_be_none:
        p.add_argument("--max-step-tokens", default="512",
                       help="tokens per launch: decode rows plus prefill chunks (chunked "
                            "prefill's budget), or 'none'")
    else:
        p.add_argument("--max-step-tokens", type=int, default=512,
                       help="tokens per launch: decode rows plus prefill chunks")
    if batching:
        p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                       help="continuous: a request joins and leaves at any step; static: a "
                            "batch runs until its longest request ends")
    p.add_argument("--quant", default="none",
                   help="weights: none, int8, int4[-gN][-awq] (labkit.quant)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine flags' values as keyword arguments of `load_model`/`Engine`:
    attention, kv_tokens, max_step_tokens, quant (a scheme name or None) and batching (if the
    command has it). A bad value raises ValueError whose message starts with its flag."""
    from labkit.quant import QuantScheme

    budget, or_none = args.max_step_tokens, ""
    if isinstance(budget, str):  # a command whose budget may be 'none'
        or_none = " (or 'none')"
        try:
            budget = None if budget.lower() == "none" else int(budget)
        except ValueError:
            raise ValueError(f"--max-step-tokens must be an integer or 'none', got "
                             f"{args.max_step_tokens!r}") from None
    for flag, value, also in (("--max-step-tokens", budget, or_none),
                              ("--kv-tokens", args.kv_tokens, "")):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1{also}, got {value}")
    try:
        scheme = QuantScheme.parse(args.quant)
    except ValueError as err:
        raise ValueError(f"--quant: {err}") from None
    kwargs = {"attention": args.attention, "kv_tokens": args.kv_tokens,
              "max_step_tokens": budget, "quant": scheme.name if scheme else None}
    if hasattr(args, "batching"):
        kwargs["batching"] = args.batching
    return kwargs
