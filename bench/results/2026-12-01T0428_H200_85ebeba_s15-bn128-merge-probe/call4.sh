#!/usr/bin/env bash
# session 15 probe: 128-key blocks WITH split-chunk merges (every 2 blocks = SPLIT 256, every 4 = SPLIT 512), O in registers
# (ptxas spills 492 B), against H and B128NM (no merges). Bits differ from H by design; accuracy checked separately.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
B="python bench/bisect_csrc.py --dir scratch/bn --variants H B128NM B128M2 B128M4"
timeout 240 $B --lens 4096 16384 --out $R/varlen > $R/varlen.log 2>&1; tail -6 $R/varlen.log; echo "t=$(( $(date +%s)-T0 ))"
timeout 100 $B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $R/p64 > $R/p64.log 2>&1; tail -3 $R/p64.log; echo "t=$(( $(date +%s)-T0 ))"
OUT=$R timeout 100 python scratch/probe_accuracy.py > $R/acc.log 2>&1; tail -30 $R/acc.log; echo "t=$(( $(date +%s)-T0 ))"
tar czf $OUT/r.tgz -C $OUT r && rm -rf $R
