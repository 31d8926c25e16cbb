#!/usr/bin/env bash
# session 13: decode chunk slots rotated per tile (ROT) against H: bits first, then engine and standard cells.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/r7; mkdir -p $R; T0=$(date +%s)
D="python bench/bisect_csrc.py --decode --dir scratch/dec --variants H ROT"
timeout 150 $D --heads 12/2 --page-size 64 --table-pages 16 --cells 1x550,32x550,64x550,128x550,256x550 --out $R/dec_engine > $R/dec_engine.log 2>&1; tail -6 $R/dec_engine.log; echo "t=$(( $(date +%s)-T0 ))"
timeout 150 $D --out $R/dec > $R/dec.log 2>&1; tail -11 $R/dec.log | cut -c1-400; echo "t=$(( $(date +%s)-T0 ))"
tar czf $OUT/r7.tgz -C $OUT r7 && rm -rf $R
