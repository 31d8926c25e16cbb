#!/usr/bin/env bash
# session 12 call 5: wgmma prefill with a producer warpgroup (PW: TMA issue + tail zeroing, full/empty mbarriers,
# no CTA barriers in the walk, setmaxnreg 40/232) vs main (H)
set -uo pipefail
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
S=$(mktemp -d)/s; mkdir -p $S
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $S/smi.txt 2>&1
B="timeout 240 python bench/bisect_csrc.py --dir scratch/bisect --variants ${VARIANTS:-H PW}"
$B --lens 4096 16384 --out $S/varlen 2>&1 | tail -6 | tee $S/varlen.log
$B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out $S/p64 2>&1 | tail -4 | tee $S/p64.log
tar czf $OUT/c5.tgz -C $S .
