#!/usr/bin/env bash
# session 13 probe: NM (no split-chunk merges, BN 64) and B128NM (128-key blocks, no merges) against H. Bits differ by design.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/r9; mkdir -p $R; T0=$(date +%s)
B="python bench/bisect_csrc.py --dir scratch/bn --variants H NM B128NM"
timeout 200 $B --lens 4096 16384 --out $R/varlen > $R/varlen.log 2>&1; tail -3 $R/varlen.log; echo "t=$(( $(date +%s)-T0 ))"
timeout 100 $B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $R/p64 > $R/p64.log 2>&1; tail -1 $R/p64.log; echo "t=$(( $(date +%s)-T0 ))"
tar czf $OUT/r9.tgz -C $OUT r9 && rm -rf $R
