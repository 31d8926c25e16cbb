#!/usr/bin/env bash
# Session 14, call 5: the attention-backward GPU tests (both kernels, selection, determinism; the Triton backend's
# GPU tests), then the whole bench_cuda at this commit (train_attention with both backwards).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=$OUT/stage; mkdir -p $S
t0=$(date +%s)
timeout 240 python -m pytest -q -rfE -m gpu -p no:cacheprovider --timeout=200 tests/kernels/test_cuda_backend.py \
  -k "attention_varlen_backward or backward_selection or varlen_lse" tests/kernels/test_attention.py \
  > $S/gpu_tests.log 2>&1; tail -3 $S/gpu_tests.log
echo "tests $(( $(date +%s) - t0 )) s"
timeout 330 python bench/bench_cuda.py --out $S 2>&1 | grep -v "^ptxas\|^    0 bytes" > $S/bench_cuda.log; grep -n "train attention\|prefill L=\|decode B=" $S/bench_cuda.log | head -40
echo "total $(( $(date +%s) - t0 )) s"
tar czf $OUT/s14_call5.tgz -C $S .
