"""Text in and out: token ids from text, and text streamed back one token at a time.

The model sees only integer ids; the tokenizer turns text into them and back. labkit wraps a
transformers fast tokenizer (`Tokenizer`) and adds what the engine needs: the end-of-sequence id
that finishes a request, the chat template for instruct models, and a streaming decoder. Two
details carry the lesson:

- A token is a run of *bytes*, not of characters: 世 spans three bytes that SmolLM2 may split
  over two tokens. Decoding the first alone gives U+FFFD, so `IncrementalDetokenizer` holds
  text back until the character is whole; its pieces always concatenate to `decode(all ids)`.
- A GGUF file carries its tokenizer in its metadata (vocabulary, merges, special ids, chat
  template). transformers rebuilds a fast tokenizer from it in seconds, so that happens once:
  the result is saved beside the model's weights in the cache (see `labkit.utils.cache`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from labkit.utils.cache import (
    ModelNotInstalled,
    build_atomically,
    cache_dir,
    cache_entry,
    packaged_gguf,
)
from labkit.utils.progress import progress

__all__ = ["IncrementalDetokenizer", "Tokenizer", "smollm2_tokenizer", "tokenizer_from_gguf"]

# in-process memo: cache entry -> its tokenizer, so a second load_model does not reread it
_TOKENIZERS: dict[Path, Tokenizer] = {}


class IncrementalDetokenizer:
    """Streams text one token at a time, holding back bytes of an unfinished UTF-8 character."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        # ids[prefix:read] were emitted already; decoding them again gives the context that
        # makes the new text decode the same as it would inside the whole sequence
        self._prefix = 0
        self._read = 0

    def _pending(self) -> tuple[str, str]:
        """(text of the ids already emitted, text of those plus the ones held back)."""
        ids, prefix, read = self.ids, self._prefix, self._read
        return self._decode(ids[prefix:read]), self._decode(ids[prefix:])

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is unfinished)."""
        self.ids.append(int(token_id))
        done, text = self._pending()
        # U+FFFD at the end: the last token stopped inside a multi-byte character; wait for more
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(done):]

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes as U+FFFD)."""
        done, text = self._pending()
        self._prefix = self._read = len(self.ids)
        return text[len(done):]


class Tokenizer:
    """Text <-> token ids: a transformers fast tokenizer plus the ids the engine needs."""

    def __init__(self, hf, eos_id: int | None = None, bos_id: int | None = None,
                 fold_to: int | None = None):
        self.hf = hf  # a transformers PreTrainedTokenizerFast
        # a model that knows only the first `fold_to` ids (the random `tiny`): encode folds the
        # others into range; with random weights only a prompt's length matters
        self.fold_to = fold_to
        eos = hf.eos_token_id if eos_id is None else eos_id
        if eos is None:
            raise ValueError("tokenizer has no end-of-sequence token: pass eos_id=... so that "
                             "generation knows when a sequence is finished")
        self.eos_id: int = int(eos)
        bos = hf.bos_token_id if bos_id is None else bos_id
        self.bos_id: int | None = None if bos is None else int(bos)
        self.vocab_size: int = len(hf)  # ids the tokenizer knows (a model may pad its vocab)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
                f"bos_id={self.bos_id})")

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of `text`; with chat=True, wrapped as one user turn of the chat template."""
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        return self._fold(list(self.hf.encode(_encodable(text, "the text"))))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation ({"role", "content"} dicts) in the chat template, ending
        where the assistant's answer starts."""
        if not self.hf.chat_template:
            raise ValueError("this tokenizer has no chat template: call encode(text) "
                             "without chat=True, or load an instruct model")
        for i, message in enumerate(messages):
            if isinstance(message.get("content"), str):
                _encodable(message["content"], f"messages[{i}].content")
        prompt = self.hf.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        # the template writes the special tokens itself
        return self._fold(list(self.hf.encode(prompt, add_special_tokens=False)))

    def _fold(self, ids: list[int]) -> list[int]:
        return ids if self.fold_to is None else [t % self.fold_to for t in ids]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of `ids`, special tokens skipped."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
        # the Rust tokenizer directly: what hf.decode does without its space clean-up (" ." ->
        # ".", which streamed pieces could not reproduce), at a tenth of the cost per call
        return self.hf.backend_tokenizer.decode(ids, skip_special_tokens=True)

    def detokenizer(self) -> IncrementalDetokenizer:
        """A fresh streaming decoder: its pushes concatenate to decode(all ids pushed)."""
        return IncrementalDetokenizer(self.decode)


def _encodable(text: str, where: str) -> str:
    """`text` itself, or a ValueError if UTF-8 cannot encode it (a lone surrogate, which JSON's
    "\\ud800" and Python strings allow; the tokenizer works on UTF-8 bytes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{where} is not valid Unicode: character {err.start} is "
                         f"{text[err.start]!r}, a lone surrogate, which UTF-8 cannot encode "
                         "(a surrogate pair must be whole)") from None
    return text


def smollm2_tokenizer() -> Tokenizer:
    """SmolLM2's tokenizer: from the model package, else from any cached tokenizer entry."""
    try:
        return tokenizer_from_gguf(packaged_gguf())
    except ModelNotInstalled:
        from transformers import PreTrainedTokenizerFast

        for entry in sorted(cache_dir().glob("*/tokenizer/labkit.json")):
            ids = json.loads(entry.read_text())
            hf = PreTrainedTokenizerFast.from_pretrained(entry.parent, local_files_only=True)
            return Tokenizer(hf, eos_id=ids["eos_id"], bos_id=ids["bos_id"])
        raise


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes, converted once by transformers and cached."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    entry = cache_entry(path) / "tokenizer"
    if entry in _TOKENIZERS:
        return _TOKENIZERS[entry]

    def build(tmp: Path) -> None:
        # slow (seconds): transformers rebuilds the BPE from the vocabulary and merges
        with progress(desc=f"building the tokenizer from {path.name} (first load only)",
                      total=1, unit="file") as bar:
            hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            hf.save_pretrained(tmp)
            bar.update()
        (tmp / "labkit.json").write_text(json.dumps(
            {"eos_id": hf.eos_token_id, "bos_id": hf.bos_token_id}))

    build_atomically(entry, build)
    ids = json.loads((entry / "labkit.json").read_text())
    hf = PreTrainedTokenizerFast.from_pretrained(entry, local_files_only=True)
    tok = _TOKENIZERS[entry] = Tokenizer(hf, eos_id=ids["eos_id"], bos_id=ids["bos_id"])
    return tok
