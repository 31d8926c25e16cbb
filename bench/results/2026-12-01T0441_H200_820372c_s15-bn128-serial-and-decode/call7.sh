#!/usr/bin/env bash
# session 15: (a) prefill, 128-key blocks WITH the split merges (SPLIT 256) but serial within the warpgroup (B128M2S),
# beside H, B128NM, B128XS; (b) the decode kernel at TIK_ATTN_BLOCK_N 128 (tree C128; its wgmma kernel is not used) vs H.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
B="python bench/bisect_csrc.py --dir scratch/bn"
timeout 200 $B --variants H B128NM B128M2S B128XS --lens 1024 4096 16384 --out $R/varlen > $R/varlen.log 2>&1; tail -3 $R/varlen.log | cut -c1-400; echo "t=$(( $(date +%s)-T0 ))"
timeout 100 $B --variants H B128NM B128M2S B128XS --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $R/p64 > $R/p64.log 2>&1; tail -1 $R/p64.log | cut -c1-400; echo "t=$(( $(date +%s)-T0 ))"
timeout 150 $B --decode --variants H C128 --cells 1x1024,1x8192,4x8192,16x1024,16x8192,64x1024 --out $R/dec > $R/dec.log 2>&1; tail -7 $R/dec.log | cut -c1-300; echo "t=$(( $(date +%s)-T0 ))"
timeout 80 $B --decode --variants H C128 --heads 12/2 --page-size 64 --table-pages 16 --cells 1x550,64x550,128x550 --out $R/dec_engine > $R/dec_engine.log 2>&1; tail -3 $R/dec_engine.log | cut -c1-300; echo "t=$(( $(date +%s)-T0 ))"
tar czf $OUT/r.tgz -C $OUT r && rm -rf $R
