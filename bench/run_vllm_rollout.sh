#!/usr/bin/env bash
# Device job for bench_rollout.py (vLLM 0.24 from wheels copied to /tmp/vw, see ../shared/vllm/README.md).
#   STAGE=A: install vLLM into /tmp/vsite, the plugin's entry point, the csrc extension (built before any arm), then
#            stock vLLM, vLLM + tik and the parity check (all four workloads).
#   STAGE=B: (same warm machine, right after A) vLLM batch-invariant and our engine (the three short
#            workloads) and our engine's parity; rollout.json/png gather every arm of the work folder.
#   ARMS (STAGE=A): the arms of that call (default "stock tik parity"). The whole table on one warm machine, two calls
#            (~570 s of arms): ARMS="stock batch_invariant engine engine_async", then ARMS="tik parity" (the work
#            folder keeps the first call's arms; rollout.json gathers them).
#   ROLLOUT_ARGS: more bench_rollout.py flags (STAGE=A), e.g. "--repeats 3". The full Qwen3-30B-A3B shape (61 GB of
#            weights; one H200): ARMS="stock engine_async" ROLLOUT_ARGS="--model qwen3-30b-a3b --preset-weights
#            --stock-weights dummy --model-dir /tmp/brw/model30b --workloads 64x136x256 256x136x256 64x1024x2048
#            256x1024x1024 --repeats 2 --engine-memory 0.8" (stock vLLM on its dummy weights: building the preset beside
#            vLLM's own parameters would hold two copies; our engine's KV cache gets 0.8 of the ~80 GB its weights leave
#            free, which holds the 256 x 2,048-token row).
#   STAGE=P: bench/bench_prefix.py (our engine, prefix sharing off vs on), then bench/probes/probe_vllm_server.py
#            (AReaL's vLLM server, stock and tik; AReaL's wheels installed in /tmp/site).
#   STAGE=T: (first, right after the wheel copies) install as in A, then the GPU tests of the rollout-side
#            stacked projections, `areal-tik verify` at the 1.5B shape (bits of the engine path) and
#            `verify --engine vllm` (VERIFY_ARGS; default 32 prompts of 8-3,072 tokens, 1,024 new) and
#            `--engine vllm --kernels default` (stock vLLM, the negative control; its files keep the name
#            verify_vllm-stock.*), VERIFY_S seconds each.
#   STAGE=M: install as in A, then the MoE checks: stock vLLM's batch-invariant mode alone vs in a crowded batch on
#            the 4-layer Qwen3-30B-A3B shape (bench/probes/probe_vllm_batch_invariance.py, MOE_PROBE_S seconds per
#            mode; MOE_PROBE=0 skips it), the routing plan's GPU tests and its kernels vs torch ops
#            (bench/probes/probe_moe_routing.py; MOE_ROUTING=0 skips it), with MOE_TILES=1 the grouped GEMMs' tile
#            probe (bench/probes/probe_moe_grouped_tiles.py, beside vLLM's fused_experts), with MOE_TESTS=1 the
#            GPU tests of the grouped GEMM, of every linear config's bits, of the fused q/k norm + RoPE and of the
#            routing plans, with MOE_PROFILE=1 our
#            engine's decode and prefill profile on the full shape at B 64 (bench/probes/profile_engine.py, prompts of
#            MOE_PROFILE_PROMPT tokens, default 1,024), then the full 30B-A3B
#            shape's speed table, ARMS (default "stock engine_async"), stock vLLM on its dummy weights. Rows by GPU
#            memory: on a GPU of 100 GB or more the four rows of the 30B-A3B command above; below that the rows whose
#            KV cache fits beside 61 GB of weights (64 x 136 -> 256, 256 x 136 -> 256, 64 x 512 -> 1,024; our
#            engine's KV share 0.7 there, 0.8 on the larger GPU). MOE_WL replaces the rows. The two arms alone fit
#            one call (~300 s on an H100); the probes with them do not: MOE_BENCH=0 runs the probes only.
#   STAGE=F: install as in A, then the fa3 backend (the attention pair on vLLM's FA3, one walk): its GPU tests,
#            `verify` at the 1.5B shape with AREAL_TIK_BACKEND=attention=fa3, and our engine on the split pair vs on
#            fa3 over the table's workloads with the parity step (ROLLOUT_ARGS, default "--repeats 3 --long-repeats 2").
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH=$PWD:/tmp/vsite
W=/tmp/brw
mkdir -p $W
if [ "${STAGE:-A}" = A ] || [ "${STAGE:-A}" = T ] || [ "${STAGE:-A}" = F ] || [ "${STAGE:-A}" = M ]; then
  # vLLM into /tmp/vsite and the plugin's entry point, as `pip install areal-tik[vllm]` declares it (setup.py)
  timeout 300 bash bench/install_vllm_wheels.sh /tmp/vw /tmp/vsite || { echo "vLLM install failed"; exit 1; }
  # the csrc extension is built before any arm runs: nvcc on every core beside a timed arm would slow that arm's
  # host side (vLLM's scheduler and ours are host-bound at small batches)
  timeout 400 python -c "from areal_tik.kernels.cuda import loader as cuda_ext; print('csrc', cuda_ext.status())" > $W/csrc.log 2>&1
  timeout 120 python -c "
import vllm, importlib.metadata as md
from areal_tik import vllm_plugin
print('vllm', vllm.__version__, vllm_plugin.available())
print([e.value for e in md.entry_points(group='vllm.general_plugins')])
from areal_tik.vllm_plugin.register import register; register()
from vllm import ModelRegistry; print(sorted(a for a in ModelRegistry.get_supported_archs() if a.startswith('Tik')))
from areal_tik.vllm_plugin import attention, model; print('plugin modules import')
" || echo "plugin import check failed"
  if [ "$STAGE" = F ]; then
    timeout 200 python -m pytest -q -rfEs -m gpu -p no:cacheprovider tests/kernels/test_fa3_backend.py 2>&1 | tail -6
    AREAL_TIK_BACKEND=attention=fa3 timeout 200 python -m areal_tik.cli verify --model qwen2.5-1.5b --json \
      > $OUT/verify_fa3.json 2> $W/verify_fa3.err || tail -5 $W/verify_fa3.err
    python -c "import json; r = json.load(open('$OUT/verify_fa3.json')); print('verify fa3', r['passed'], r['n_mismatch_total'])" 2>&1 | tail -1
    timeout ${BENCH_S:-330} python bench/bench_rollout.py --out $OUT --work $W --model-dir $W/model \
      --arms engine_async engine_fa3 parity --budget ${BENCH_S:-330} --arm-timeout 150 --long-reserve 100 \
      ${ROLLOUT_ARGS:---repeats 3 --long-repeats 2}
    exit 0
  fi
  if [ "$STAGE" = M ]; then
    if [ "${MOE_PROBE:-1}" = 1 ]; then
      timeout $(( 2 * ${MOE_PROBE_S:-200} + 30 )) python bench/probes/probe_vllm_batch_invariance.py \
        --model qwen3-30b-a3b-4l --timeout ${MOE_PROBE_S:-200} --out $OUT/vllm_batch_invariance_moe.json 2>&1 | tail -3
    fi
    # the GPU tests of the kernels the MoE shape runs on: grouped GEMM rows == linear rows (BLOCK_M 16-128), every
    # linear config's bits equal (the 30B-A3B o projection among the shapes), the fused q/k norm + RoPE == the two
    # ops apart, the routing plans (two and three launches) == the torch plan; off unless MOE_TESTS=1
    [ "${MOE_TESTS:-0}" = 1 ] && timeout ${MOE_TESTS_S:-300} python -m pytest -q -p no:cacheprovider -m gpu \
      tests/kernels/test_moe_grouped_linear.py "tests/kernels/test_linear.py::test_gpu_all_configs_bit_identical" \
      tests/kernels/test_qk_norm_rope.py tests/kernels/test_moe_routing.py 2>&1 | tail -4
    if [ "${MOE_ROUTING:-1}" = 1 ]; then
      timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe_routing.py 2>&1 | tail -3
      timeout 150 python bench/probes/probe_moe_routing.py --out $OUT/moe_routing 2>&1 | tail -7
    fi
    # the grouped GEMMs' tile candidates against the shipped table and vLLM's fused_experts (off unless MOE_TILES=1)
    [ "${MOE_TILES:-0}" = 1 ] && timeout ${MOE_TILES_S:-300} python bench/probes/probe_moe_grouped_tiles.py \
      --out $OUT/moe_tiles 2>&1 | grep "^T " | tail -12
    # where our engine's decode step goes on the full shape with a long context (off unless MOE_PROFILE=1)
    [ "${MOE_PROFILE:-0}" = 1 ] && timeout ${MOE_PROFILE_S:-200} python bench/probes/profile_engine.py \
      --out $OUT/moe_profile --model qwen3-30b-a3b --kernels tik --async-decode --batches 64 \
      --prompt-len ${MOE_PROFILE_PROMPT:-1024} --steps 16 --memory 0.5 --prefill 2>&1 | grep -v "^ *cpu" | tail -24
    gb=$(python -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
    if [ "$gb" -ge 100 ]; then WL=${MOE_WL:-"64x136x256 256x136x256 64x1024x2048 256x1024x1024"}; EM=0.8
    else WL=${MOE_WL:-"64x136x256 256x136x256 64x512x1024"}; EM=0.7; fi
    echo "GPU ${gb} GiB: rows $WL"
    [ "${MOE_BENCH:-1}" = 1 ] && timeout ${BENCH_S:-470} python bench/bench_rollout.py --out $OUT --work $W --model-dir $W/model30b \
      --model qwen3-30b-a3b --preset-weights --stock-weights dummy --engine-memory $EM --arms ${ARMS:-stock engine_async} \
      --workloads $WL --budget ${BENCH_S:-470} --arm-timeout ${ARM_S:-300} --long-reserve 120 ${ROLLOUT_ARGS:---repeats 2}
    exit 0
  fi
  if [ "$STAGE" = T ]; then
    timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py::test_gpu_stacked_projections_equal_separate \
      tests/kernels/test_silu_mul_packed.py tests/layers/test_stacking.py tests/engine/test_graph_capture.py 2>&1 | tail -5
    timeout 200 python -m areal_tik.cli verify --model qwen2.5-1.5b --json > $OUT/verify.json 2> $W/verify.err \
      || tail -5 $W/verify.err
    python -c "import json; r = json.load(open('$OUT/verify.json')); print({k: v for k, v in r.items() if 'mismatch' in k or k in ('ok', 'passed')})" 2>&1 | tail -2
    # vLLM's scheduler regimes (batching, chunked prefill, preemption, graphs, abort). vLLM + tik: prompts of 8 to
    # 3,072 tokens, 1,024 generated each (>= 16k tokens per regime, contexts to 4K); stock vLLM, the negative
    # control, on a small set (it only has to mismatch)
    for k in tik default; do
      if [ $k = tik ]; then e=vllm; VA=${VERIFY_ARGS:-"--prompts 32 --max-prompt-len 3072 --max-new-tokens 1024"}
      else e=vllm-stock; VA="--prompts 16 --max-prompt-len 600 --max-new-tokens 64"; fi
      timeout ${VERIFY_S:-300} python -m areal_tik.cli verify --engine vllm --kernels $k --model qwen2.5-1.5b $VA \
        --json > $OUT/verify_$e.json 2> $W/verify_$e.err \
        || grep -v "it/s\]\|^INFO\|^WARNING" $W/verify_$e.err | tail -5 > $OUT/verify_$e.err
      python -c "import json; r = json.load(open('$OUT/verify_$e.json')); print('$e', r['passed'], r['regimes'])" 2>&1 | tail -1
    done
    exit 0
  fi
  timeout ${BENCH_S:-470} python bench/bench_rollout.py --out $OUT --work $W --model-dir $W/model --arms ${ARMS:-stock tik parity} \
    --budget ${BENCH_S:-470} --arm-timeout 200 --long-reserve 150 ${ROLLOUT_ARGS:-}
elif [ "$STAGE" = P ]; then
  # prefix sharing on vs off in our engine (GRPO-shaped), then AReaL's vLLM servers (needs AReaL in /tmp/site)
  timeout ${PREFIX_S:-150} python bench/bench_prefix.py --out $OUT/prefix 2>&1 | grep -v "it/s\]" | tail -6
  PYTHONPATH=$PWD:/tmp/vsite:/tmp/site HF_HUB_OFFLINE=1 timeout ${PROBE_S:-300} python bench/probes/probe_vllm_server.py \
    --out $OUT/probe --model qwen2.5-1.5b --kernels ${PROBE_KERNELS:-tik,default} \
    --server-pythonpath $PWD:/tmp/vsite:/tmp/site-vllm 2>&1 | grep -v "it/s\]" | tail -25
else
  timeout ${BENCH_S:-400} python bench/bench_rollout.py --out $OUT --work $W --model-dir $W/model \
    --arms batch_invariant engine parity --quick --budget ${BENCH_S:-400} --arm-timeout 170
fi
cat $W/csrc.log 2>/dev/null | tail -3
