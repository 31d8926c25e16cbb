#!/usr/bin/env bash
# session 13 call 1: review-refactor checks (GPU tests + verify) on main, then prefill bisect H / A / P / PA.
export PYTHONPATH=$PWD GIT_COMMIT=$(git rev-parse --short HEAD 2>/dev/null) PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
rm -f areal_tik/_C*.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $R/smi.txt 2>&1
( python -c "
import sys; sys.path.insert(0,'bench'); import bisect_csrc as b, multiprocessing as mp, os
jobs=[(os.path.abspath('scratch/bisect'),v) for v in 'H A P PA'.split()]
with mp.get_context('spawn').Pool(4) as p: print(p.map(b._build_seconds, jobs))
" > $R/prebuild.log 2>&1 ) &
BPID=$!
timeout 300 python -m pytest -q -rfE -m gpu tests/kernels/test_cuda_backend.py tests/engine/test_graph_capture.py -p no:cacheprovider --timeout=300 > $R/gpu_tests.log 2>&1; echo "rc=$? t=$(( $(date +%s)-T0 ))" >> $R/gpu_tests.log
tail -3 $R/gpu_tests.log
timeout 150 python -m areal_tik.cli verify --model qwen2.5-1.5b --prompts 16 --max-prompt-len 300 --max-new-tokens 64 --json > $R/verify.json 2> $R/verify.err; echo "verify rc=$? t=$(( $(date +%s)-T0 ))"
grep -o '"n_mismatch_total": [0-9]*' $R/verify.json
wait $BPID; cat $R/prebuild.log | tail -2; echo "prebuilt t=$(( $(date +%s)-T0 ))"
B="python bench/bisect_csrc.py --dir scratch/bisect --variants H A P PA"
timeout 120 $B --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 256 512 --out $R/b64 > $R/b64.log 2>&1; tail -2 $R/b64.log; echo "t=$(( $(date +%s)-T0 ))"
timeout 100 $B --lens 4096 16384 --out $R/long > $R/long.log 2>&1; tail -2 $R/long.log; echo "t=$(( $(date +%s)-T0 ))"
timeout 80 $B --heads 12/2 --prefill-paged 64 --prefill-batch 16 --lens 1024 2048 --out $R/b16 > $R/b16.log 2>&1; tail -2 $R/b16.log; echo "t=$(( $(date +%s)-T0 ))"
tar czf $OUT/r.tgz -C $OUT r && rm -rf $R
