#!/usr/bin/env bash
# Session 14, call 6: the Triton backend's GPU tests (its backward now through the selector), and one training
# micro-batch (bench/profile_train.py, tik kernels) with the default attention backward vs the Triton one.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=$OUT/stage; mkdir -p $S
t0=$(date +%s)
timeout 200 python -m pytest -q -rfE -m gpu -p no:cacheprovider --timeout=150 tests/kernels/test_attention.py \
  > $S/gpu_tests_triton_attention.log 2>&1; tail -2 $S/gpu_tests_triton_attention.log
echo "tests $(( $(date +%s) - t0 )) s"
for shape in "32 272" "8 2048"; do
  set -- $shape
  for bwd in auto triton; do
    AREAL_TIK_ATTN_BACKWARD=$bwd timeout 150 python bench/profile_train.py --out $S/train_${1}x${2}_$bwd --seqs $1 --seq-len $2 \
      --kernels tik > $S/train_${1}x${2}_$bwd.log 2>&1; echo "$shape $bwd rc $? $(( $(date +%s) - t0 )) s"
    grep -v "^    " $S/train_${1}x${2}_$bwd.log | tail -3
  done
done
tar czf $OUT/s14_call6.tgz -C $S .
