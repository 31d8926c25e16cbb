#!/usr/bin/env bash
# One device call: tune linear + attention, apply the winners, then re-test and re-bench with them.
#   STAGE=tune  bash bench/device_round.sh   -> $OUT/tune/results.tgz, $OUT/final/results.tgz
#   STAGE=system bash bench/device_round.sh  -> engine/parity/cuda/logprobs tests and benches
#   STAGE=next   bash bench/device_round.sh  -> what the third session runs first: cuda backend
#                GPU tests (single decode path), log-prob tests, cuda/engine/profile/dense benches
#                (session 2 ran the parity/isolation/verify round: bench/results/*_parity-r2)
#   STAGE=s3     bash bench/device_round.sh  -> the short version of 'next' run in session 3 (tests + cuda bench)
#   STAGE=s4 / s5: session 4's first and last rounds (profiles; sampler + precompile checks)
#   STAGE=s6: session 5's first call (sampler negative control, precompile dtype fix)
# The tuned tables (areal_tik/kernels/linear/linear_tuned.json, areal_tik/kernels/attention_tuned.json) come back in the archives
# and are committed by hand after checking the re-tests passed.
set -u
cd "$(dirname "$0")/.."
ROOT_OUT=$OUT
case "${STAGE:-tune}" in
  tune)
    mkdir -p $ROOT_OUT/tune $ROOT_OUT/final
    OUT=$ROOT_OUT/tune BENCH_ARGS="--budget-s ${TUNE_S:-110}" bash bench/gpu_check.sh env tune_linear tune_attention
    mkdir -p /tmp/tuned && tar xzf $ROOT_OUT/tune/results.tgz -C /tmp/tuned
    [ -f /tmp/tuned/linear_tuned.json ] && cp /tmp/tuned/linear_tuned.json areal_tik/kernels/linear/ && echo "applied linear_tuned.json"
    [ -f /tmp/tuned/attention_tuned.json ] && cp /tmp/tuned/attention_tuned.json areal_tik/kernels/ && echo "applied attention_tuned.json"
    OUT=$ROOT_OUT/final GPU_TESTS="tests/kernels/test_linear.py tests/kernels/test_attention.py tests/kernels/test_dense_small.py tests/kernels/test_logprobs.py" \
      bash bench/gpu_check.sh env tests dense attention
    ;;
  system)
    mkdir -p $ROOT_OUT/system
    OUT=$ROOT_OUT/system GPU_TESTS="tests/kernels/test_cuda_backend.py tests/engine tests/test_negative_controls.py" \
      bash bench/gpu_check.sh env tests negctl engine parity cuda
    ;;
  next)   # session 3 first call: the single-path cuda decode (40 GPU tests), the row-blocked logits
          # backward, engine throughput with median prefill, the engine step profile, dense in graphs
    mkdir -p $ROOT_OUT/next
    OUT=$ROOT_OUT/next GPU_TESTS="tests/kernels/test_cuda_backend.py tests/kernels/test_logprobs.py tests/engine/test_default_varlen.py" \
      PART_TIMEOUT=150 bash bench/gpu_check.sh env tests cuda engine profile dense
    ;;
  s3)     # session 3 first call (2 GPUs): the single-path cuda decode (40 GPU tests), the row-blocked
          # logits backward, the baseline's torch varlen_attn (forward + backward, used by the A/B's
          # baseline arm), the cuda-vs-Triton-vs-SDPA attention bench
    mkdir -p $ROOT_OUT/s3
    OUT=$ROOT_OUT/s3 GPU_TESTS="tests/engine/test_default_varlen.py tests/kernels/test_cuda_backend.py tests/kernels/test_logprobs.py" \
      PART_TIMEOUT=${PART_TIMEOUT:-150} bash bench/gpu_check.sh env tests cuda
    ;;
  s4)     # session 4 first call: where tik loses in the 2x H200 A/B (rollout at B=128, train step, our
          # linears vs cuBLAS at M=128 inside CUDA graphs),
          # plus the new GPU tests (Triton weights digest)
    mkdir -p $ROOT_OUT/s4
    OUT=$ROOT_OUT/s4 GPU_TESTS="tests/test_weights_digest.py tests/engine/test_graph_capture.py" \
      PROFILE_ARGS="--batches 64 128 --prompt-len 136" PART_TIMEOUT=${PART_TIMEOUT:-180} \
      bash bench/gpu_check.sh env tests profile profile_train dense
    ;;
  s5)     # session 4 last round, first call (2 GPUs): the fused Gumbel sampler (GPU test + engine
          # profile's sample phase at B=64/128), precompiled linears compile nothing more at any M,
          # graph capture on cuda:1 with the runner's own device, the engine's R1-R5 parity on the
          # new sampler
    mkdir -p $ROOT_OUT/s5
    OUT=$ROOT_OUT/s5 GPU_TESTS="tests/kernels/test_gumbel.py tests/kernels/test_precompile.py tests/engine/test_graph_capture.py tests/engine/test_parity.py" \
      PROFILE_ARGS="--batches 64 128 --prompt-len 136" PART_TIMEOUT=${PART_TIMEOUT:-150} \
      bash bench/gpu_check.sh env tests profile
    ;;
  s6)     # session 5 first call (2 GPUs): the Gumbel sampler's negative control and the precompile's
          # compute-dtype fix (the trainer must precompile bf16 configs, not FSDP2's fp32 masters)
    mkdir -p $ROOT_OUT/s6
    OUT=$ROOT_OUT/s6 GPU_TESTS="tests/kernels/test_gumbel.py tests/kernels/test_precompile.py" \
      PART_TIMEOUT=${PART_TIMEOUT:-150} bash bench/gpu_check.sh env tests
    ;;
esac
