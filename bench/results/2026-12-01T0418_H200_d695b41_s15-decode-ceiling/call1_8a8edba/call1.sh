#!/usr/bin/env bash
# Session 15, call 1: the ceiling bench, then the whole GPU suite and verify at HEAD (fresh JIT build).
set -uo pipefail
rm -f areal_tik/_C*.so; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=$OUT/r; mkdir -p $S; t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $S/smi.txt 2>&1
python -m areal_tik.cli env --json > $S/env.json 2> $S/env.err; echo "env $(( $(date +%s) - t0 )) s"
timeout 150 python bench/bench_ceiling.py --out $S > $S/bench_ceiling.log 2>&1; echo "ceiling rc=$? $(( $(date +%s) - t0 )) s"; grep -E "ceiling|floor|cells|prefill" $S/bench_ceiling.log | head -8
timeout 270 python -m pytest -q -rfE -m gpu tests --ignore=tests/areal -p no:cacheprovider --timeout=240 --junitxml=$S/gpu_tests.xml > $S/gpu_tests.log 2>&1; tail -3 $S/gpu_tests.log; echo "tests $(( $(date +%s) - t0 )) s"
timeout 120 python -m areal_tik.cli verify --model qwen2.5-1.5b --prompts 16 --max-prompt-len 300 --max-new-tokens 64 --json > $S/verify.json 2> $S/verify.err; grep -E '"passed"|n_mismatch_total' $S/verify.json | head -8; echo "verify $(( $(date +%s) - t0 )) s"
tar czf $OUT/r.tgz -C $OUT r && rm -rf $S; echo "done $(( $(date +%s) - t0 )) s"
