#!/usr/bin/env bash
# session 12 call 4: decode grid order heads-fastest (HO) vs main (H, TMA loader); ring depth 2/3 with TMA
set -uo pipefail
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
S=$(mktemp -d)/s; mkdir -p $S
B="timeout 200 python bench/bisect_csrc.py --decode --dir scratch/bisect --variants H HO"
$B --cells 16x8192,8x4096,64x1024,1x8192,16x1024 --out $S/dec 2>&1 | tail -8 | tee $S/dec.log
$B --heads 12/2 --table-pages 16 --cells 1x550,64x550,128x550,256x550 --out $S/eng 2>&1 | tail -6 | tee $S/eng.log
B="timeout 150 python bench/bisect_csrc.py --decode --dir scratch/bisect --variants H --stages 0 2 3"
$B --cells 16x8192,64x1024,16x1024 --out $S/st 2>&1 | tail -5 | tee $S/st.log
$B --heads 12/2 --table-pages 16 --cells 64x550,128x550,256x550 --out $S/st_eng 2>&1 | tail -5 | tee $S/st_eng.log
tar czf $OUT/c4.tgz -C $S .
