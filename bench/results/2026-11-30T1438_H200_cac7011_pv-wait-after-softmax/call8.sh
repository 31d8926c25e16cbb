#!/bin/bash
# session 10, call 8: the P V wait after the softmax (BR: a never-taken branch keeps ptxas from hoisting it;
# PBZ: + P packed before the wait into other registers; FPBZ: + S's first k-step write-only) vs main (H)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s); st() { echo "== $1 at $(( $(date +%s) - t0 )) s"; }
mkdir -p $OUT/r
B="timeout 100 python bench/bisect_csrc.py --dir scratch/bisect"
st p64; $B --variants H BR PBZ FPBZ --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $OUT/r/p64 2>&1 | tail -3
st varlen; $B --variants FPBZ PBZ BR H --lens 4096 16384 --out $OUT/r/varlen 2>&1 | tail -2
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
st done
