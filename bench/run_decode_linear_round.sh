#!/usr/bin/env bash
# One device call (~5 min, no vLLM needed): the rollout's decode GEMMs at M 64/128 under every tile config
# (bench/probes/probe_decode_linear.py, which writes a table with the winners), then our engine's rollout (pipelined,
# default) with the committed table and with the new one, side by side, after the GPU bit tests of the new table.
#   ROUND_MS (64,128) the decode batches probed; PROBE_S (150) the probe's budget; WL the bench_rollout workloads;
#   LAYER (1.5b) the model shape: 7b probes the 7B layer and its lm_head and runs the arms on the 7B preset's
#   weights (no checkpoint written); 30b-a3b probes the Qwen3-30B-A3B's dense GEMMs (q/k/v, o, router, lm_head) and
#   runs the arms on its preset's weights (WL default there: the two short rows).
# Then here: copy $OUT/linear_tuned.json to areal_tik/kernels/linear/ if "after" is faster and the tests passed.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=/tmp/ldr
mkdir -p $W
WL_GIVEN=${WL:-}
WL=${WL:-"64x136x256 128x136x256 64x1024x4096"}
LAYER=${LAYER:-1.5b}
if [ "$LAYER" = 7b ]; then PROBE_ARGS="--layer 7b --lm-head"; MODEL_ARGS="--model qwen2.5-7b --preset-weights --model-dir $W/model7b"
elif [ "$LAYER" = 30b-a3b ]; then  # its dense GEMMs; the arms on the full MoE shape's preset weights (61 GB)
  gb=$(python -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
  PROBE_ARGS="--layer 30b-a3b --lm-head"
  MODEL_ARGS="--model qwen3-30b-a3b --preset-weights --model-dir $W/model30b --engine-memory $([ "$gb" -ge 100 ] && echo 0.8 || echo 0.7)"
  WL=${WL_GIVEN:-"64x136x256 256x136x256"}
else PROBE_ARGS="--layer $LAYER"; MODEL_ARGS="--model-dir $W/model"; fi
timeout $(( ${PROBE_S:-150} + 60 )) python bench/probes/probe_decode_linear.py --out $OUT/probe $PROBE_ARGS --ms ${ROUND_MS:-64,128} \
  --budget-s ${PROBE_S:-150} --write-table $OUT/linear_tuned.json 2>&1 | tail -14
cp areal_tik/kernels/linear/linear_tuned.json $W/linear_tuned_before.json
arm() {  # $1 = label
  timeout ${ARM_S:-150} python bench/bench_rollout.py --out $OUT/$1 --work $W/$1 $MODEL_ARGS --arms engine_async \
    --workloads $WL --repeats 3 --long-repeats 2 --arm-timeout $(( ${ARM_S:-150} - 10 )) 2>&1 | grep "tok/s\|rc " | tail -6
}
arm before
if [ -s $OUT/linear_tuned.json ]; then
  cp $OUT/linear_tuned.json areal_tik/kernels/linear/linear_tuned.json
  timeout 200 python -m pytest -q -p no:cacheprovider -rfEs tests/kernels/test_linear.py \
    -k "gpu_all_configs_bit_identical or gpu_stacked_projections" 2>&1 | tail -4
  arm after
  [ "${AGAIN:-1}" = 1 ] && { cp $W/linear_tuned_before.json areal_tik/kernels/linear/linear_tuned.json; arm before2; }
fi
exit 0
