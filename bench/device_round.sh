#!/usr/bin/env bash
# One device call: tune linear + attention, apply the winners, then re-test and re-bench with them.
#   STAGE=tune  bash bench/device_round.sh   -> $OUT/tune/results.tgz, $OUT/final/results.tgz
#   STAGE=system bash bench/device_round.sh  -> $OUT/system/results.tgz: the cuda-backend, engine and negative-control
#                GPU tests, then the engine, parity and cuda benches
# The tuned tables (areal_tik/kernels/{linear,attention}_tuned.json) come back in the archives
# and are committed by hand after checking the re-tests passed.
set -u
cd "$(dirname "$0")/.."
ROOT_OUT=$OUT
case "${STAGE:-tune}" in
  tune)
    mkdir -p $ROOT_OUT/tune $ROOT_OUT/final
    OUT=$ROOT_OUT/tune BENCH_ARGS="--budget-s ${TUNE_S:-110}" bash bench/gpu_check.sh env tune_linear tune_attention
    mkdir -p /tmp/tuned && tar xzf $ROOT_OUT/tune/results.tgz -C /tmp/tuned
    for f in linear_tuned.json attention_tuned.json; do
      [ -f /tmp/tuned/$f ] && cp /tmp/tuned/$f areal_tik/kernels/$f && echo "applied $f"
    done
    OUT=$ROOT_OUT/final GPU_TESTS="tests/kernels/test_linear.py tests/kernels/test_attention.py tests/kernels/test_dense_small.py tests/kernels/test_logprobs.py" \
      bash bench/gpu_check.sh env tests dense attention
    ;;
  system)
    mkdir -p $ROOT_OUT/system
    OUT=$ROOT_OUT/system GPU_TESTS="tests/kernels/test_cuda_*.py tests/engine tests/layers tests/verify tests/test_negative_controls.py" \
      bash bench/gpu_check.sh env tests negctl engine parity cuda
    ;;
esac
