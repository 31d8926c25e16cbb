#!/bin/bash
# session 10, call 2: host cost per op + cProfile of eager prefill; PO bisect in the other order; prefill profile without autograd
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s"; }
mkdir -p $OUT/r
st host1; timeout 200 python bench/host_overhead.py --out $OUT/r/host_b1 --tokens 512 --batch 1 2>&1 | grep -v "^  self" | tail -14
st host16; timeout 200 python bench/host_overhead.py --out $OUT/r/host_b16 --tokens 512 --batch 16 --parts cprofile 2>&1 | tail -12
B="timeout 150 python bench/bisect_csrc.py --dir scratch/bisect --variants PO H --triton"
st p64; $B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $OUT/r/p64 2>&1 | tail -1
st varlen; $B --lens 16384 4096 --out $OUT/r/varlen 2>&1 | tail -2
st prof; timeout 150 python bench/profile_engine.py --kernels tik --batches 1 16 --prefill --out $OUT/r/prof > $OUT/r/prof.log 2>&1; grep -v "^      " $OUT/r/prof.log | tail -4
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
st done
