#!/bin/bash
# session 10, call 1: checks at HEAD, prologue-overlap bisect, page size 64 vs 16 (kernels + engine profile)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
rm -f areal_tik/_C*.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/smi.txt 2>&1
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s"; }
st tests; timeout 200 python -m pytest -q -m gpu tests/kernels/test_cuda_backend.py -p no:cacheprovider --junitxml=$OUT/gpu_tests.xml > $OUT/gpu_tests.log 2>&1; tail -3 $OUT/gpu_tests.log
st verify; timeout 150 python -m areal_tik.cli verify --model qwen2.5-1.5b --prompts 16 --max-prompt-len 300 --max-new-tokens 64 --json > $OUT/verify.json 2> $OUT/verify.err; tail -c 600 $OUT/verify.json
B="timeout 150 python bench/bisect_csrc.py --dir scratch/bisect --variants H PO --triton"
st p64; $B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $OUT/p64 2>&1 | tail -4
st p16; $B --heads 12/2 --prefill-paged 16 --prefill-batch 64 --lens 512 --out $OUT/p16 2>&1 | tail -4
st varlen; $B --lens 1024 4096 16384 --out $OUT/varlen 2>&1 | tail -5
D="timeout 100 python bench/bisect_csrc.py --dir scratch/bisect --variants H --triton --decode --heads 12/2"
st dec16; $D --page-size 16 --table-pages 64 --cells 1x550,64x550,128x550 --out $OUT/dec16 2>&1 | tail -5
st dec64; $D --page-size 64 --table-pages 16 --cells 1x550,64x550,128x550 --out $OUT/dec64 2>&1 | tail -5
for ps in 16 64; do st prof$ps; timeout 150 python bench/profile_engine.py --kernels tik --batches 1 64 --prefill --page-size $ps --out $OUT/prof$ps > $OUT/prof$ps.log 2>&1; grep -v "^      " $OUT/prof$ps.log | tail -4; done
st done
