#!/usr/bin/env bash
# Device job after a structural change and a kernel change, one call: engine decode steps before/after in one
# machine window, `verify` at the 1.5B shape, then the whole GPU suite (last, with what time is left: -v logs every
# test as it ends, so a cut run still shows what passed).
#   Before/after: OLD (a tree of an earlier commit, e.g. `git archive <commit> areal_tik csrc bench/... | tar -x -C
#   .carry/old`, carried) vs this tree with that commit's linear op (OLD_TABLE, --k-splits none) isolates the code
#   change at the 1.5B shape; this tree with and without its K split and tile rules gives the kernel change at the
#   7B and 1.5B shapes.
# Each step has its own timeout (PROF_S, VERIFY_S, SUITE_S); everything lands in $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
NEW=$PWD; OLD=${OLD:-$PWD/.carry/old}; OLD_TABLE=${OLD_TABLE:-$PWD/.carry/old_linear_tuned.json}
OUT=${OUT:-/tmp/outfinal}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/smi.txt" 2>&1
PYTHONPATH=$NEW timeout 300 python -c "from areal_tik.kernels.cuda import loader as c; print('csrc', c.status()[0])" 2>&1 | tail -1
prof() {  # label, tree, model, extra args
  PYTHONPATH=$2 timeout "${PROF_S:-75}" python $2/bench/probes/profile_engine.py --out "$OUT/prof_$1" --model $3 --kernels tik \
    --batches 64 256 --prompt-len 136 --steps 16 --async-decode ${@:4} 2>&1 | grep -E "ms/step" | sed "s/^/$1 /"
}
prof new_oldlinear_7b "$NEW" qwen2.5-7b --k-splits none --linear-table "$OLD_TABLE"
prof new_7b "$NEW" qwen2.5-7b
[ -d "$OLD" ] && prof old_1.5b "$OLD" qwen2.5-1.5b
prof new_oldlinear_1.5b "$NEW" qwen2.5-1.5b --k-splits none --linear-table "$OLD_TABLE"
prof new_1.5b "$NEW" qwen2.5-1.5b
PYTHONPATH=$NEW timeout "${VERIFY_S:-90}" python -m areal_tik.cli verify --model qwen2.5-1.5b --prompts 16 --max-prompt-len 300 \
  --max-new-tokens 64 --json > "$OUT/verify_1.5b.json" 2> "$OUT/verify_1.5b.err"; echo "verify rc $?"
python - "$OUT/verify_1.5b.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    print("verify:", {r: (v.get("passed"), v.get("n_mismatch"), v.get("n_tokens")) for r, v in d["regimes"].items()},
          "passed" if d.get("passed", all(v.get("passed") for v in d["regimes"].values())) else "FAILED")
except Exception as e:
    print("verify json unreadable:", e)
PY
PYTHONPATH=$NEW timeout "${SUITE_S:-280}" python -m pytest -v -rfEs -m gpu tests -p no:cacheprovider --timeout=200 \
  > "$OUT/gpu_tests.log" 2>&1; echo "gpu suite rc $?"
grep -cE " PASSED" "$OUT/gpu_tests.log" | sed 's/^/passed: /'; grep -E " FAILED| ERROR" "$OUT/gpu_tests.log" | head -20; tail -4 "$OUT/gpu_tests.log"
