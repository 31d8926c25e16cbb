#!/usr/bin/env bash
# End-to-end A/B on the GPU machine (issue 7): AReaL recompute baseline vs tik, 1.5B shapes.
# NOT RUN YET. The device has no areal/hydra/ray and no network: the lead carries wheels
# (areal==1.0.4 --no-deps + requirements/areal.txt) into .whl/ and installs them first:
#   pip install --no-index --find-links .whl -c requirements/constraints.txt -r requirements/areal.txt
#   pip install --no-index --find-links .whl --no-deps areal==1.0.4 && pip install --no-build-isolation -e .
# Without the Qwen weights/tokenizer/GSM8K on the device, the recipes run on the preset
# qwen2.5-1.5b (random init, exact shapes), the shipped char tokenizer, and the generated
# 'mix' arithmetic set; throughput (not reward) is what this measures then.
# Layout: trainer on GPU 0; rollout server on GPU 1 when 2 GPUs are visible (AREAL_TIK_SERVER_DEVICE).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/ab}
STEPS=${STEPS:-10}
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then export AREAL_TIK_SERVER_DEVICE=cuda:1; fi
OFFLINE=(actor.path=preset:qwen2.5-1.5b tokenizer_path=builtin:tiny-char "train_dataset.path=builtin:arith/mix?n=8192"
         gconfig.max_new_tokens=512 gconfig.max_tokens=1024 rollout.setup_timeout=900)
if [ -n "${QWEN_DIR:-}" ]; then  # real weights + tokenizer available locally
  OFFLINE=(actor.path=$QWEN_DIR tokenizer_path=$QWEN_DIR "${GSM8K_OVERRIDE[@]:-train_dataset.path=builtin:arith/mix?n=8192}")
fi
python -m areal_tik.cli env --json > "$OUT.env.json" 2>/dev/null || true
for RECIPE in grpo ppo; do
  python -m areal_tik.cli ab --config recipes/${RECIPE}_qwen2.5-1.5b_gsm8k.yaml --steps "$STEPS" \
      --out "$OUT/$RECIPE" --timeout 3000 "${OFFLINE[@]}" "${EXTRA[@]:-actor.tik.audit_interval=5}" \
    | tee "$OUT/$RECIPE.summary.txt"
done
