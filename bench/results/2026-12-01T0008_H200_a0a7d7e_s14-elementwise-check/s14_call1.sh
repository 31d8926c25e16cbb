#!/usr/bin/env bash
# Session 14, call 1: JIT build, the elementwise + agent GPU tests, the elementwise bench (before any export).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=$OUT/stage; mkdir -p $S
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $S/smi.txt 2>&1
t0=$(date +%s)
python -c "from areal_tik.kernels import cuda_ops; m=cuda_ops.extension(); print('ext', m.__file__, m.ELEMENTWISE_API)" 2>&1 | tail -3
echo "build $(( $(date +%s) - t0 )) s"
timeout 420 python -m pytest -q -rfE -m gpu -p no:cacheprovider --timeout=400 \
  "tests/kernels/test_cuda_backend.py::test_apply_rope_bits_invariance_accuracy" \
  "tests/kernels/test_cuda_backend.py::test_apply_rope_backward_transpose_bits" \
  "tests/kernels/test_cuda_backend.py::test_apply_rope_backward" \
  "tests/kernels/test_cuda_backend.py::test_rms_norm_backward" \
  "tests/kernels/test_cuda_backend.py::test_rms_norm_row_invariance_and_accuracy" \
  tests/kernels/test_dense_small.py tests/agent/test_csrc_root.py 2>&1 | tee $S/gpu_tests.log | tail -25
echo "tests done $(( $(date +%s) - t0 )) s"
timeout 120 python bench/bench_cuda.py --elementwise-only --out $S/ew_before 2>&1 | tee $S/ew_before.log | tail -20
echo "total $(( $(date +%s) - t0 )) s"
tar czf $OUT/s14_call1.tgz -C $S .
