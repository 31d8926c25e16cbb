#!/usr/bin/env bash
# Our engine's rollout speed at an older tree and at this one, side by side on one GPU: each tree runs its own
# bench/bench_rollout.py (arm engine_async: the engine's defaults) on the same checkpoint, alternating trees round by
# round so drift in the machine's state falls on both. One device call (~5 min at the 1.5B shape).
#   Here, first: git archive <commit> | (mkdir -p .before && tar -x -C .before)   (~6 MB; untracked, so it travels
#   with the working tree; delete it afterwards, it is never committed)
#   There:       bash bench/run_before_after.sh
# Knobs: BEFORE (.before), ROUNDS (2) rounds of (before, after), WL (the workloads), ARM_S (120 s per arm),
# MODEL_ARGS (extra bench_rollout flags, e.g. "--model qwen2.5-7b --preset-weights": then no checkpoint is written).
# Each tree builds its csrc extension into its own TORCH_EXTENSIONS_DIR before any arm runs (the sources may differ).
# Prints each workload's tokens/s per tree (median over rounds) and after / before; files under $OUT/<tree>_<round>.
set -u
cd "$(dirname "$0")/.."
BEFORE=${BEFORE:-.before}
[ -f "$BEFORE/areal_tik/__init__.py" ] || { echo "no older tree in $BEFORE (see this script's header)"; exit 2; }
W=/tmp/bab
mkdir -p "$W"
WL=${WL:-"64x136x256 256x136x256 64x1024x4096"}
export PYTHONUNBUFFERED=1
tree_of() { if [ "$1" = before ]; then echo "$BEFORE"; else echo .; fi; }
in_tree() {  # $1 = before|after, then the command, run in that tree with its own package and extension build
  local t=$1; shift
  (cd "$(tree_of "$t")" && TORCH_EXTENSIONS_DIR=/tmp/ext_$t PYTHONPATH=$PWD "$@")
}
for t in before after; do
  in_tree $t timeout 400 python -c "from areal_tik.kernels.cuda import loader as c; print('$t csrc', c.status()[0])" 2>&1 | tail -1
done
for r in $(seq 1 "${ROUNDS:-2}"); do
  for t in before after; do
    in_tree $t timeout "${ARM_S:-120}" python bench/bench_rollout.py --out "$OUT/${t}_$r" --work "$W/${t}_$r" \
      --model-dir "$W/model" --arms engine_async --workloads $WL --repeats 3 --long-repeats 1 \
      --arm-timeout $(( ${ARM_S:-120} - 10 )) ${MODEL_ARGS:-} 2>&1 | grep "tok/s\|rc " | tail -5
  done
done
python - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
rates = {}
for f in sorted(glob.glob(os.path.join(out, "*_*", "rollout.json"))):
    tree = os.path.basename(os.path.dirname(f)).split("_")[0]
    for wl, v in json.load(open(f))["arms"]["engine_async"]["workloads"].items():
        rates.setdefault(wl, {}).setdefault(tree, []).append(v["tokens_per_s"])
rows = {}
for wl, by in rates.items():
    b, a = statistics.median(by.get("before", [0])), statistics.median(by.get("after", [0]))
    rows[wl] = {"before": by.get("before"), "after": by.get("after"), "after_over_before": round(a / b, 3) if b else None}
    print(f"{wl:>18}  before {b:9.1f}  after {a:9.1f}  after/before {rows[wl]['after_over_before']}")
json.dump(rows, open(os.path.join(out, "before_after.json"), "w"), indent=1)
PY
