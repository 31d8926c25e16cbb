#!/usr/bin/env bash
# session 15 probe: the "exact-split" recurrence (X_j = P_j V_j from zero, acc = fma(acc, alpha_j, X_j)) at 128-key blocks without merges:
# B128X overlaps S_j with P_{j-1} V_{j-1} (ptxas spills 476 B), B128XS serial within the warpgroup (0 spills). Bits differ from H by design.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
B="python bench/bisect_csrc.py --dir scratch/bn --variants H B128NM B128X B128XS"
timeout 240 $B --lens 4096 16384 --out $R/varlen > $R/varlen.log 2>&1; tail -6 $R/varlen.log; echo "t=$(( $(date +%s)-T0 ))"
timeout 100 $B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $R/p64 > $R/p64.log 2>&1; tail -3 $R/p64.log; echo "t=$(( $(date +%s)-T0 ))"
OUT=$R timeout 100 python scratch/probe_accuracy.py > $R/acc.log 2>&1; tail -30 $R/acc.log; echo "t=$(( $(date +%s)-T0 ))"
tar czf $OUT/r.tgz -C $OUT r && rm -rf $R
