#!/usr/bin/env bash
# session 12 call 8: persistent wgmma prefill (PS: one CTA per SM, tiles from a device counter, producer warpgroup
# prefetches the next tile's Q and K/V; 5 stages, 24/240 registers) vs H = HEAD
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
S=$(mktemp -d)/s; mkdir -p $S
timeout 110 python bench/bisect_csrc.py --dir scratch/bisect --variants H PS --lens 4096 16384 --out $S/varlen 2>&1 | tail -4 | tee $S/varlen.log
timeout 40 python bench/bisect_csrc.py --dir scratch/bisect --variants H PS --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $S/p64 2>&1 | tail -2 | tee $S/p64.log
tar czf $OUT/c8.tgz -C $S .
