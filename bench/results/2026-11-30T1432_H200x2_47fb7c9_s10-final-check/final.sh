rm -f areal_tik/_C*.so; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; mkdir -p $OUT/r; t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv > $OUT/r/smi.txt 2>&1
python -m areal_tik.cli env --json > $OUT/r/env.json 2> $OUT/r/env.err; echo "env $(( $(date +%s) - t0 )) s"
timeout 150 python -m areal_tik.cli verify --model qwen2.5-1.5b --prompts 16 --max-prompt-len 300 --max-new-tokens 64 --json > $OUT/r/verify.json 2> $OUT/r/verify.err; grep -E '"passed"|n_mismatch_total' $OUT/r/verify.json; echo "verify $(( $(date +%s) - t0 )) s"
timeout 330 python -m pytest -q -rfE -m gpu tests --ignore=tests/areal -p no:cacheprovider --timeout=240 --junitxml=$OUT/r/gpu_tests.xml > $OUT/r/gpu_tests.log 2>&1; tail -4 $OUT/r/gpu_tests.log; echo "tests $(( $(date +%s) - t0 )) s"
timeout 70 python bench/profile_engine.py --kernels tik --batches 1 64 --prefill --out $OUT/r/prof > $OUT/r/prof.log 2>&1; grep -v "^      " $OUT/r/prof.log | tail -4
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r; echo "done $(( $(date +%s) - t0 )) s"
