#!/bin/bash
# session 10, call 5: persistent wgmma prefill (PS: old grid order, next tile found once per tile by thread 32, kept in shared memory) vs main (H)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s"; }
mkdir -p $OUT/r
B="timeout 150 python bench/bisect_csrc.py --dir scratch/bisect --triton"
st p64; $B --variants H PS --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $OUT/r/p64 2>&1 | tail -2
st p16; $B --variants PS H --heads 12/2 --prefill-paged 16 --prefill-batch 64 --lens 512 --out $OUT/r/p16 2>&1 | tail -1
st b8; $B --variants PS H --heads 12/2 --prefill-paged 64 --prefill-batch 8 --lens 1024 256 --out $OUT/r/b8 2>&1 | tail -2
st varlen; $B --variants PS H --lens 1024 4096 16384 --out $OUT/r/varlen 2>&1 | tail -3
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
st done
