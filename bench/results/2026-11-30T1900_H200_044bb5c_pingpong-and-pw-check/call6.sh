#!/usr/bin/env bash
# session 12 call 6: pingpong turns on top of the producer warpgroup (PP vs H = HEAD); then the landed producer
# warpgroup through the cuda GPU tests, verify and bench_cuda
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 GIT_COMMIT=$(git rev-parse --short HEAD)
S=$(mktemp -d)/s; mkdir -p $S
B="timeout 200 python bench/bisect_csrc.py --dir scratch/bisect --variants H PP"
$B --lens 4096 16384 --out $S/pp_varlen 2>&1 | tail -4 | tee $S/pp_varlen.log
$B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $S/pp_p64 2>&1 | tail -2 | tee $S/pp_p64.log
rm -f areal_tik/_C*.so
python -m pytest -q -rfE -m gpu tests/kernels/test_cuda_backend.py tests/engine/test_graph_capture.py -p no:cacheprovider --timeout=300 > $S/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -3 $S/gpu_tests.log
timeout 150 python -m areal_tik.cli verify --model qwen2.5-1.5b --prompts 16 --max-prompt-len 300 --max-new-tokens 64 --json > $S/verify.json; echo "verify rc=$?"; grep -m3 '"passed"\|n_mismatch_total' $S/verify.json
OUT=$S PART_TIMEOUT=150 bash bench/gpu_check.sh cuda > $S/cuda_part.log 2>&1; grep -i "prefill\|train" $S/cuda_part.log | head -20
tar czf $OUT/c6.tgz -C $S .
