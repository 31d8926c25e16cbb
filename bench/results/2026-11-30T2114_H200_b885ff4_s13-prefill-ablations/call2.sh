#!/usr/bin/env bash
# session 13 call 2: where the producer-warpgroup prefill's time goes (ablations incl. KONLY = half the bytes).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/r2; mkdir -p $R; T0=$(date +%s)
python bench/csrc_ablations.py --out scratch/abl --variants NOSM NOPV NOS SKEL KONLY > /dev/null
B="python bench/bisect_csrc.py --dir scratch/abl --variants H NOSM NOPV NOS SKEL KONLY"
timeout 200 $B --lens 4096 16384 --out $R/varlen > $R/varlen.log 2>&1; tail -3 $R/varlen.log; echo "t=$(( $(date +%s)-T0 ))"
timeout 100 $B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $R/p64 > $R/p64.log 2>&1; tail -1 $R/p64.log; echo "t=$(( $(date +%s)-T0 ))"
tar czf $OUT/r2.tgz -C $OUT r2 && rm -rf $R
