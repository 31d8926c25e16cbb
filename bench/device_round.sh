#!/usr/bin/env bash
# One device call: tune linear + attention, apply the winners, then re-test and re-bench with them.
#   STAGE=tune  bash bench/device_round.sh   -> $OUT/tune/results.tgz, $OUT/final/results.tgz
#   STAGE=system bash bench/device_round.sh  -> engine/parity/cuda/logprobs tests and benches
#   STAGE=next   bash bench/device_round.sh  -> what the second session must run first: decode
#                isolation tests, 1.5B parity (tik + default), verify with the cuda backend,
#                engine and dense benches (dense small shapes now timed in CUDA graphs)
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
    OUT=$ROOT_OUT/system GPU_TESTS="tests/kernels/test_cuda_backend.py tests/engine tests/test_negative_controls.py" \
      bash bench/gpu_check.sh env tests negctl engine parity cuda
    ;;
  next)
    mkdir -p $ROOT_OUT/next
    OUT=$ROOT_OUT/next bash bench/gpu_check.sh env isolate parity
    ( export OUT=$ROOT_OUT/next2; mkdir -p $OUT
      AREAL_TIK_BACKEND="attention_varlen=cuda,attention_paged=cuda,kv_cache_write=cuda,rms_norm=cuda,apply_rope=cuda" \
        timeout 240 python -m areal_tik.cli verify --model qwen2.5-1.5b --prompts 16 --max-prompt-len 300 \
        --max-new-tokens 64 --json > /tmp/verify_cuda.json; echo "verify (cuda backend) exit $?"
      mkdir -p /tmp/vc && cp /tmp/verify_cuda.json /tmp/vc/ && tar czf $OUT/verify_cuda.tgz -C /tmp/vc . )
    ;;
esac
