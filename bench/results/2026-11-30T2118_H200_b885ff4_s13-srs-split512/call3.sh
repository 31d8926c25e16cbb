#!/usr/bin/env bash
# session 13 call 3: SRS probe (S's A operand from registers) and SPLIT 512 (prefill + decode) against H.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/r3; mkdir -p $R; T0=$(date +%s)
rm -rf scratch/abl3; python bench/csrc_ablations.py --out scratch/abl3 --variants SRS > /dev/null
cp -r scratch/abl3/H scratch/abl3/S512 && sed -i 's/#define TIK_ATTN_SPLIT 256 /#define TIK_ATTN_SPLIT 512 /' scratch/abl3/S512/tik_api.h
grep -c "SPLIT 512" scratch/abl3/S512/tik_api.h
B="python bench/bisect_csrc.py --dir scratch/abl3 --variants H SRS S512"
timeout 200 $B --lens 4096 16384 --out $R/varlen > $R/varlen.log 2>&1; tail -3 $R/varlen.log; echo "t=$(( $(date +%s)-T0 ))"
timeout 100 $B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $R/p64 > $R/p64.log 2>&1; tail -1 $R/p64.log; echo "t=$(( $(date +%s)-T0 ))"
D="python bench/bisect_csrc.py --decode --dir scratch/abl3 --variants H S512"
timeout 120 $D --cells 1x8192,4x8192,16x8192,64x1024,128x512 --out $R/dec > $R/dec.log 2>&1; tail -6 $R/dec.log; echo "t=$(( $(date +%s)-T0 ))"
timeout 80 $D --heads 12/2 --page-size 64 --table-pages 16 --cells 1x550,64x550 --out $R/dec_engine > $R/dec_engine.log 2>&1; tail -2 $R/dec_engine.log; echo "t=$(( $(date +%s)-T0 ))"
tar czf $OUT/r3.tgz -C $OUT r3 && rm -rf $R
