#!/usr/bin/env bash
# session 12 call 7: producer-warpgroup prefill knobs: consumers at 240 registers (R240), 5 ring stages (S5),
# TMA L2 promotion 128B instead of 256B (L2P128, prefill and decode) vs H = HEAD
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
S=$(mktemp -d)/s; mkdir -p $S
B="timeout 200 python bench/bisect_csrc.py --dir scratch/bisect --variants H R240 S5 L2P128"
$B --lens 4096 16384 --out $S/varlen 2>&1 | tail -4 | tee $S/varlen.log
$B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $S/p64 2>&1 | tail -2 | tee $S/p64.log
timeout 100 python bench/bisect_csrc.py --decode --dir scratch/bisect --variants H L2P128 --cells 16x8192,64x1024 --out $S/dec 2>&1 | tail -3 | tee $S/dec.log
tar czf $OUT/c7.tgz -C $S .
