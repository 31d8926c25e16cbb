#!/usr/bin/env bash
# session 13: the P V wait after the softmax in the producer-warpgroup prefill: BR (never-taken branch pin),
# DB (P double-buffered: pa[j & 1]), DBBR (both), against H. Bits first.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/r8; mkdir -p $R; T0=$(date +%s)
B="python bench/bisect_csrc.py --dir scratch/db --variants H BR DB DBBR"
timeout 200 $B --lens 4096 16384 --out $R/varlen > $R/varlen.log 2>&1; tail -3 $R/varlen.log; echo "t=$(( $(date +%s)-T0 ))"
timeout 100 $B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $R/p64 > $R/p64.log 2>&1; tail -1 $R/p64.log; echo "t=$(( $(date +%s)-T0 ))"
tar czf $OUT/r8.tgz -C $OUT r8 && rm -rf $R
