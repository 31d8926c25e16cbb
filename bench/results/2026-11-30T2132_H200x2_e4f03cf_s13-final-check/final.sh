rm -f areal_tik/_C*.so; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 GIT_COMMIT=$(git rev-parse --short HEAD 2>/dev/null); mkdir -p $OUT/r; t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv > $OUT/r/smi.txt 2>&1
python -m areal_tik.cli env --json > $OUT/r/env.json 2> $OUT/r/env.err; echo "env $(( $(date +%s) - t0 )) s"
timeout 150 python -m areal_tik.cli verify --model qwen2.5-1.5b --prompts 16 --max-prompt-len 300 --max-new-tokens 64 --json > $OUT/r/verify.json 2> $OUT/r/verify.err; grep -E '"passed"|n_mismatch_total' $OUT/r/verify.json | head -8; echo "verify $(( $(date +%s) - t0 )) s"
timeout 300 python -m pytest -q -rfE -m gpu tests --ignore=tests/areal -p no:cacheprovider --timeout=240 --junitxml=$OUT/r/gpu_tests.xml > $OUT/r/gpu_tests.log 2>&1; tail -4 $OUT/r/gpu_tests.log; echo "tests $(( $(date +%s) - t0 )) s"
timeout 170 python bench/bench_cuda.py --out $OUT/r > $OUT/r/bench_cuda.log 2>&1; echo "bench_cuda rc=$?"; tail -3 $OUT/r/bench_cuda.log
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r; echo "done $(( $(date +%s) - t0 )) s"
