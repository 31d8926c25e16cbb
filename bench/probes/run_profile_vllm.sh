#!/usr/bin/env bash
# Device job: vLLM from /tmp/vw (bench/install_vllm_wheels.sh: vLLM and the plugin's entry point), the csrc
# extension, a random checkpoint of MODEL (default qwen2.5-1.5b; PRESET_WEIGHTS=1: a config-only folder, every arm
# builds the preset's seeded weights: the 7B shape), then bench/probes/profile_vllm_step.py (ARMS, default
# "stock tik engine"; BATCH, default 64; TIK_KWARGS: JSON merged into the tik arm's engine arguments).
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=$PWD:/tmp/vsite
W=/tmp/brw
mkdir -p $W
timeout 300 bash bench/install_vllm_wheels.sh /tmp/vw /tmp/vsite || { echo "vLLM install failed"; exit 1; }
timeout 300 python -c "from areal_tik.kernels.cuda import loader as cuda_ext; print('csrc', cuda_ext.status())" 2>&1 | tail -2
M=${MODEL:-qwen2.5-1.5b}; D=$W/model_$M${PRESET_WEIGHTS:+_preset}
[ -f $D/bench_meta.json ] || timeout 120 python -c "
import sys; sys.path.insert(0, 'bench'); import bench_rollout as br; print(br.make_checkpoint('$M', '$D', bool('${PRESET_WEIGHTS:-}')))"
timeout ${PROFILE_S:-420} python bench/probes/profile_vllm_step.py --model-dir $D --out $OUT --batch ${BATCH:-64} \
  --arms ${ARMS:-stock tik engine} ${TIK_KWARGS:+--tik-kwargs "$TIK_KWARGS"} --arm-timeout ${ARM_TIMEOUT:-150}
