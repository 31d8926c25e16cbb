#!/usr/bin/env bash
# Session 14, call 9: after the review edits (rope_pair / table_row; env's attention-backward line).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=$OUT/stage; mkdir -p $S
timeout 300 python -m pytest -q -rfE -m gpu -p no:cacheprovider --timeout=250 tests/kernels/test_cuda_backend.py \
  -k "rope or rms or backward_selection" tests/kernels/test_attention_backward_select.py > $S/gpu_tests.log 2>&1; tail -2 $S/gpu_tests.log
python -m areal_tik.cli env --json > $S/env.json 2>&1; grep attention_backward $S/env.json
AREAL_TIK_ATTN_BACKWARD=triton python -m areal_tik.cli env --json | grep attention_backward
tar czf $OUT/s14_call9.tgz -C $S .
