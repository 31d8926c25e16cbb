#!/bin/bash
# session 10, call 3: persistent wgmma prefill (PS) vs main (H); then the cuda tests with PS as the extension
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s"; }
mkdir -p $OUT/r
B="timeout 150 python bench/bisect_csrc.py --dir scratch/bisect --triton"
st p64; $B --variants H PS --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $OUT/r/p64 2>&1 | tail -3
st p16; $B --variants H PS --heads 12/2 --prefill-paged 16 --prefill-batch 64 --lens 512 --out $OUT/r/p16 2>&1 | tail -1
st b8; $B --variants PS H --heads 12/2 --prefill-paged 64 --prefill-batch 8 --lens 1024 256 --out $OUT/r/b8 2>&1 | tail -2
st varlen; $B --variants PS H --lens 1024 4096 16384 --out $OUT/r/varlen 2>&1 | tail -3
cp scratch/bisect/PS/* csrc/ && rm -f areal_tik/_C*.so
st tests; timeout 220 python -m pytest -q -m gpu tests/kernels/test_cuda_backend.py -p no:cacheprovider > $OUT/r/gpu_tests_PS.log 2>&1; tail -3 $OUT/r/gpu_tests_PS.log
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
st done
