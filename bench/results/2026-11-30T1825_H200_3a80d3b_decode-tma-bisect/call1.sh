#!/usr/bin/env bash
# session 12 call 1: TMA decode loader bisect (bits first) + copy-path probe with tma_box
set -uo pipefail
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
S=$(mktemp -d)/s; mkdir -p $S
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $S/smi.txt 2>&1
B="timeout 200 python bench/bisect_csrc.py --decode --dir scratch/bisect --variants H TMA"
$B --cells 16x8192,8x4096,64x1024,1x8192 --out $S/dec 2>&1 | tail -30 | tee $S/dec.log
$B --heads 12/2 --table-pages 16 --cells 1x550,64x550,128x550 --out $S/eng 2>&1 | tail -12 | tee $S/eng.log
$B --heads 12/2 --page-size 16 --table-pages 64 --cells 64x550 --out $S/eng_p16 2>&1 | tail -8 | tee $S/eng_p16.log
timeout 150 python bench/probe_load_paths.py --paths cpasync bulk16k tma_box --out $S/load_paths 2>&1 | tail -20 | tee $S/load_paths.log
tar czf $OUT/c1.tgz -C $S .
