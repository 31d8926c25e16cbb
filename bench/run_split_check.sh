#!/usr/bin/env bash
# Device job: the fixed K split of the down projections, checked and measured in one call.
#   1. the csrc extension; 2. the GPU tests of the linear op (every config under a split, the split kernel in a
#   CUDA graph); 3. probe_split_linear on the down projections (decode M and the training-M cost);
#   4. engine decode steps (MODELS, default the 7B shape) with the split (the committed K_SPLITS) and without it
#   (--k-splits none), B 64 and 256 over short prompts, one process each; 5. with VERIFY=1, `areal-tik verify` at
#   the 1.5B shape. LINEAR_TESTS adds test files to step 2.
source "$(dirname "$0")/device_start.sh" /tmp/outsplit
timeout 300 python -m pytest -q -rfEs -m gpu tests/kernels/test_linear_split.py ${LINEAR_TESTS:-} -p no:cacheprovider \
  -x 2>&1 | tee "$OUT/gpu_linear_tests.log" | tail -8
timeout 300 python bench/probes/probe_split_linear.py --out "$OUT" --shapes 7b_down,1.5b_down --splits 2,4 \
  --train-ms 2048,8192 2>&1 | tee "$OUT/split_linear.log" | grep -v "^K=" | tail -12
for model in ${MODELS:-qwen2.5-7b}; do
  for ks in default none; do
    extra=""; [ "$ks" = none ] && extra="--k-splits none"
    timeout 200 python bench/probes/profile_engine.py --out "$OUT/prof_${model}_$ks" --model $model --kernels tik \
      --batches 64 256 --prompt-len 136 --steps 16 --async-decode $extra 2>&1 | grep -E "ms/step" | sed "s/^/$model k_splits=$ks /"
  done
done
[ "${VERIFY:-0}" = 1 ] && timeout 200 python -m areal_tik.cli verify --model qwen2.5-1.5b --prompts 16 --max-prompt-len 300 --max-new-tokens 64 --json \
  > "$OUT/verify_1.5b.json" 2> "$OUT/verify_1.5b.err" && tail -c 600 "$OUT/verify_1.5b.json"
