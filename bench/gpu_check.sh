#!/usr/bin/env bash
# Run on the device: GPU tests + benchmarks, JSON/logs under $OUT.
#   bash bench/gpu_check.sh [PART ...]   parts: env tests negctl <bench name without bench_/.py> ...; default: all
#   GPU_TESTS='tests/kernels/test_x.py ...' limits the tests part; part "shards" runs them in parallel processes
#   (GPU_SHARDS); part "isolate" runs the decode-path
#   isolation tests (tests/engine/test_gpu_decode_isolation.py + the tiny GPU parity) into gpu_isolate.log;
#   part "profile" splits an engine decode step into host phases + top device ops (bench/probes/profile_engine.py,
#   PROFILE_ARGS e.g. "--batches 64 128 --prompt-len 136": contexts 136..235 stay in one 16-page table-width
#   bucket, so no graph capture lands inside the timed steps); part "profile_train" times a training micro-batch
#   (forward, forward+backward) per kernels mode with its top device ops (bench/probes/profile_train.py);
#   part "backend_ab" runs bench_engine / profile_engine / profile_train with the attention pair on the default
#   backend vs forced Triton (bench/kernel_arms.py; compare device-busy times, the engine step is host-bound);
#   part "fused_ab" checks and times the fused gate/up + SiLU-and-multiply (bench/probes/probe_gate_up_silu.py) and our
#   engine with it on vs off (bench_engine arms tik vs tik@linear_silu_mul=torch_ref, FUSED_MODELS);
#   part "ablations" times copies of the csrc attention kernels with one part removed (bench/probes/csrc_ablations.py);
#   part "host" measures the host cost per op call and cProfiles an eager engine prefill (bench/probes/host_overhead.py);
#   part "prefill_graphs" times engine prefill steps eager vs graph-replayed (bench_engine arms pg0 / pg4096);
#   part "attention_pair" times the attention pair under the split-KV contract vs FA3 num_splits=1 (vLLM on PYTHONPATH;
#   bench/probes/probe_attention_pair.py); part "load_paths" times the decode copy paths alone (bench/probes/probe_load_paths.py: cp.async, bulk, TMA boxes);
#   parts "tune_linear" / "tune_attention" run the tile tuners (bench/tune_linear.py, bench/tune_attention.py; BENCH_ARGS
#   e.g. "--budget-s 110"); bench/device_round.sh tunes, applies and re-tests in one call;
#   PART_TIMEOUT (s, default 900) bounds each bench/profile part, so one slow part cannot cost the archive; BENCH_ARGS is passed to every bench script (e.g. --quick)
# Every bench_*.py writes its JSON and appends harness rows to $OUT/rows.csv (bench/harness.py).
# Locally, file $OUT with bench/collect_results.py: bench/results/<date>_<gpu>_<commit>_<label>/ (summaries, JSON and
# figures only), the rows into bench/data/<gpu>.csv, the figures drawn by bench/plot_results.py (bench/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
FINAL_OUT="${OUT:-$PWD/bench/results/local}"
# The device returns at most 8 files: stage everything and pack it into one archive at the end.
OUT="$(mktemp -d)/stage"; mkdir -p "$OUT"; export OUT
pack() { tar czf "$FINAL_OUT/results.tgz" -C "$OUT" . && echo "packed $(find "$OUT" -type f | wc -l) files into $FINAL_OUT/results.tgz"; }
trap pack EXIT
PARTS=("$@"); [ ${#PARTS[@]} -eq 0 ] && PARTS=(env tests negctl $(ls bench/bench_*.py 2>/dev/null | sed 's#bench/bench_##; s#\.py##'))
status=0
commit=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export GIT_COMMIT="$commit"  # the device's copy of the tree has no .git: the harness rows take the commit from here
echo "{\"commit\": \"$commit\", \"date\": \"$(date -u +%FT%TZ)\", \"parts\": \"${PARTS[*]}\"}" > "$OUT/run_meta.json"
for part in "${PARTS[@]}"; do
  t0=$(date +%s)
  case "$part" in
    env) python -m areal_tik.cli env --json > "$OUT/env.json" || status=1; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >> "$OUT/env_smi.txt" 2>&1
         # pretrained weights cached on the device? (the A/B's reward comparison needs real weights)
         ( ls -la ~/.cache/huggingface/hub; du -sh ~/.cache/huggingface/hub/* ) > "$OUT/hf_cache.txt" 2>&1 ;;
    tests) python -m pytest -q -rfEs -m gpu ${GPU_TESTS:-tests} -p no:cacheprovider --timeout=300 --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    shards) # the GPU tests in parallel pytest processes on the one GPU (compile-bound: ~3x faster on 16 cores); GPU_SHARDS
         # = test paths, shards separated by ';' (a last shard REST: every other test). Each shard logs to gpu_tests_<i>.log; the csrc extension is built first.
         python -c "from areal_tik.kernels.cuda import loader as c; print('csrc', c.status()[0])" 2>&1 | tail -1
         IFS=';' read -ra SH <<< "${GPU_SHARDS:-tests/kernels/test_attention.py tests/kernels/test_linear.py tests/kernels/test_linear_split.py;tests/engine tests/verify;tests/kernels/test_cuda_attention.py tests/kernels/test_cuda_attention_backward.py tests/kernels/test_cuda_decode_merge.py tests/kernels/test_fa3_backend.py;REST}"
         last=$(( ${#SH[@]} - 1 ))
         if [ "${SH[$last]}" = REST ]; then  # the last shard: every test path the others do not name
           SH[$last]="tests $(for j in $(seq 0 $(( last - 1 ))); do for t in ${SH[$j]}; do printf -- '--ignore=%s ' "$t"; done; done)"
         fi
         TO=$(python -c "import pytest_timeout" 2>/dev/null && echo --timeout=300)
         for i in "${!SH[@]}"; do
           timeout "${PART_TIMEOUT:-900}" python -m pytest -v -rfEs -m gpu ${SH[$i]} -p no:cacheprovider $TO > "$OUT/gpu_tests_$i.log" 2>&1 &
         done
         for i in "${!SH[@]}"; do wait -n || status=1; done
         for i in "${!SH[@]}"; do echo "shard $i: $(tail -1 "$OUT/gpu_tests_$i.log")"; done
         grep -hE " FAILED| ERROR" "$OUT"/gpu_tests_*.log | head -30 ;;
    isolate) python -m pytest -q -rfEs -m gpu tests/engine/test_gpu_decode_isolation.py tests/verify/test_parity.py -p no:cacheprovider --timeout=300 --junitxml="$OUT/gpu_isolate.xml" 2>&1 | tee "$OUT/gpu_isolate.log" | tail -60; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    negctl) python bench/negative_controls.py --out "$OUT" || status=1 ;;
    profile) timeout "${PART_TIMEOUT:-900}" python bench/probes/profile_engine.py --out "$OUT" ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile_engine.log" | tail -60; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    backend_ab) # the attention pair on the architecture's default backend (csrc on sm90) vs Triton, one process per script
         T="tik@attention_varlen=triton,attention_paged=triton"
         timeout "${PART_TIMEOUT:-900}" python bench/bench_engine.py --out "$OUT/backend_ab" --arms tik "$T" 2>&1 | tee "$OUT/backend_ab_engine.log" | tail -16; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
         timeout "${PART_TIMEOUT:-900}" python bench/probes/profile_engine.py --out "$OUT/backend_ab" --batches 1 64 --prefill --kernels tik "$T" 2>&1 | tee "$OUT/backend_ab_profile.log" | grep -v "^      " | tail -6; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
         timeout "${PART_TIMEOUT:-900}" python bench/probes/profile_train.py --out "$OUT/backend_ab" --kernels tik "$T" 2>&1 | tee "$OUT/backend_ab_train.log" | grep -v "^    " | tail -4; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    fused_ab) # the MLP's gate/up GEMM + SiLU-and-multiply fused (linear_silu_mul) vs apart: its GPU bit tests, the
         # kernel probe (bench/probes/probe_gate_up_silu.py) and our engine with the fusion on vs off (the fused op on
         # torch_ref: modules.fuses then runs the two Triton ops apart) at the 1.5B and 7B shapes (FUSED_MODELS)
         timeout 300 python -m pytest -q -rfEs -m gpu tests/kernels/test_linear_silu_mul.py -p no:cacheprovider 2>&1 | tail -4
         timeout "${PART_TIMEOUT:-900}" python bench/probes/probe_gate_up_silu.py --out "$OUT/fused_ab" 2>&1 | tail -8
         for mdl in ${FUSED_MODELS:-qwen2.5-1.5b qwen2.5-7b}; do
           timeout "${PART_TIMEOUT:-900}" python bench/bench_engine.py --out "$OUT/fused_ab/$mdl" --model "$mdl" \
             --batches 64 128 256 --prompt-len 136 --arms tik "tik@linear_silu_mul=torch_ref" 2>&1 | tail -8; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
         done ;;
    ablations) # where the csrc attention kernels' time goes (bench/probes/csrc_ablations.py variants, built here from csrc/)
         python bench/probes/csrc_ablations.py --out "$OUT/ablation_trees" > /dev/null || status=1
         B="timeout ${PART_TIMEOUT:-900} python bench/probes/bisect_csrc.py --dir $OUT/ablation_trees"
         $B --variants H NOSM NOPV NOS SKEL --heads 12/2 --prefill-paged 64 --prefill-batch 64 --lens 512 --out "$OUT/ablations/p64" 2>&1 | tail -1
         $B --variants H NOSM NOPV NOS SKEL --lens 4096 16384 --out "$OUT/ablations/varlen" 2>&1 | tail -2
         $B --decode --variants H DECLOAD --cells 16x8192,8x4096,64x1024 --out "$OUT/ablations/dec" 2>&1 | tail -3
         $B --decode --variants H DECLOAD --heads 12/2 --page-size 64 --table-pages 16 --cells 1x550,64x550 --out "$OUT/ablations/dec_engine" 2>&1 | tail -2
         rm -rf "$OUT/ablation_trees" ;;  # (the variants' bits differ by design: bisect's exit status is not a failure here)
    prefill_graphs) timeout "${PART_TIMEOUT:-900}" python bench/bench_engine.py --arms tik --prefill-graph-max-tokens 0 4096 --batches 1 2 4 8 --out "$OUT/prefill_graphs" 2>&1 | tee "$OUT/prefill_graphs.log" | tail -6; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    attention_pair) timeout "${PART_TIMEOUT:-900}" python bench/probes/probe_attention_pair.py --out "$OUT/attention_pair" 2>&1 | tee "$OUT/attention_pair.log" | tail -24; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    load_paths) timeout "${PART_TIMEOUT:-900}" python bench/probes/probe_load_paths.py --out "$OUT/load_paths" 2>&1 | tee "$OUT/load_paths.log" | tail -4; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    host) timeout "${PART_TIMEOUT:-900}" python bench/probes/host_overhead.py --out "$OUT/host" 2>&1 | tee "$OUT/host_overhead.log" | grep -v "^  self" | tail -14; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    tune_linear|tune_attention) timeout "${PART_TIMEOUT:-900}" python "bench/${part}.py" --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/${part}.log" | tail -40; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    profile_train) timeout "${PART_TIMEOUT:-900}" python bench/probes/profile_train.py --out "$OUT" 2>&1 | tee "$OUT/profile_train.log" | tail -40; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    *) timeout "${PART_TIMEOUT:-900}" python "bench/bench_${part}.py" --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_${part}.log" | tail -60; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
  esac
  echo "== part $part done in $(( $(date +%s) - t0 )) s (status so far $status)"
done
exit $status
