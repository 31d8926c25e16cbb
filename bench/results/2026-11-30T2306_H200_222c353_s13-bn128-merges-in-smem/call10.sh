#!/usr/bin/env bash
# session 13 probe: B128SM (128-key blocks, SPLIT 256 merges kept, merged O in shared memory, 2 stages) beside H / NM / B128NM.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/r10; mkdir -p $R; T0=$(date +%s)
B="python bench/bisect_csrc.py --dir scratch/bn --variants H NM B128NM B128SM"
timeout 200 $B --lens 4096 16384 --out $R/varlen > $R/varlen.log 2>&1; tail -3 $R/varlen.log; echo "t=$(( $(date +%s)-T0 ))"
timeout 100 $B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $R/p64 > $R/p64.log 2>&1; tail -1 $R/p64.log; echo "t=$(( $(date +%s)-T0 ))"
OUT=$R timeout 60 python scratch/probe_accuracy.py H B128SM > $R/acc.log 2>&1; cat $R/acc.log | tail -14
tar czf $OUT/r10.tgz -C $OUT r10 && rm -rf $R
