#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=$OUT/stage; mkdir -p $S
timeout 300 python -m pytest -q -rfE -m gpu -p no:cacheprovider --timeout=250 tests/kernels/test_cuda_backend.py \
  -k "rms or stale" tests/agent/test_csrc_root.py::test_rms_export_runs_the_version_gpu > $S/gpu_tests.log 2>&1; tail -2 $S/gpu_tests.log
tar czf $OUT/s14_call10.tgz -C $S .
