#!/usr/bin/env bash
# session 13 call 4: row sum as a tree in softmax_block (RT = the working tree) and the NOSHFL probe, against H.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/r4; mkdir -p $R; T0=$(date +%s)
rm -f areal_tik/_C*.so
( python -c "
import sys; sys.path.insert(0,'bench'); import bisect_csrc as b, multiprocessing as mp, os
jobs=[(os.path.abspath('scratch/abl4'),v) for v in 'H RT NOSHFL'.split()]
with mp.get_context('spawn').Pool(3) as p: print(p.map(b._build_seconds, jobs))
" > $R/prebuild.log 2>&1 ) &
BPID=$!
timeout 300 python -m pytest -q -rfE -m gpu tests/kernels/test_cuda_backend.py -p no:cacheprovider --timeout=300 > $R/gpu_tests.log 2>&1; echo "rc=$? t=$(( $(date +%s)-T0 ))" >> $R/gpu_tests.log; tail -2 $R/gpu_tests.log
wait $BPID; tail -1 $R/prebuild.log
B="python bench/bisect_csrc.py --dir scratch/abl4 --variants RT H NOSHFL"
timeout 150 $B --lens 4096 16384 --out $R/varlen > $R/varlen.log 2>&1; tail -3 $R/varlen.log; echo "t=$(( $(date +%s)-T0 ))"
timeout 100 $B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 256 512 --out $R/p64 > $R/p64.log 2>&1; tail -2 $R/p64.log; echo "t=$(( $(date +%s)-T0 ))"
D="python bench/bisect_csrc.py --decode --dir scratch/abl4 --variants RT H"
timeout 100 $D --cells 1x8192,16x8192,128x512 --out $R/dec > $R/dec.log 2>&1; tail -4 $R/dec.log; echo "t=$(( $(date +%s)-T0 ))"
timeout 80 $D --heads 12/2 --page-size 64 --table-pages 16 --cells 1x550,64x550 --out $R/dec_engine > $R/dec_engine.log 2>&1; tail -2 $R/dec_engine.log; echo "t=$(( $(date +%s)-T0 ))"
tar czf $OUT/r4.tgz -C $OUT r4 && rm -rf $R
