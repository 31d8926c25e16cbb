#!/usr/bin/env bash
# Device job: where a 7B decode step goes in our engine, and which fixed split of K the decode GEMMs want.
#   1. the csrc extension (built before anything is timed);
#   2. bench/probes/probe_split_linear.py (SPLIT_ARGS; the 1.5B and 7B rollout GEMMs at decode M, split counts,
#      the training-M cost);
#   3. bench/probes/profile_engine.py at the 7B shape: decode at B 64 over ~2K contexts and at B 256 over short
#      prompts (PROFILE_S seconds each), per phase and per device op.
# Everything lands in $OUT (the device returns it). Each step has its own timeout.
source "$(dirname "$0")/device_start.sh" /tmp/out7b
if [ "${SKIP_SPLIT:-0}" != 1 ]; then
  timeout "${SPLIT_S:-420}" python bench/probes/probe_split_linear.py --out "$OUT" ${SPLIT_ARGS:-} 2>&1 | tee "$OUT/split_linear.log" | tail -60
fi
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  timeout "${PROFILE_S:-240}" python bench/probes/profile_engine.py --out "$OUT/prof_b64" --model qwen2.5-7b --kernels tik \
    --batches 64 --prompt-len 1900 --steps 16 --async-decode 2>&1 | tee "$OUT/prof_b64.log" | tail -24
  timeout "${PROFILE_S:-240}" python bench/probes/profile_engine.py --out "$OUT/prof_b256" --model qwen2.5-7b --kernels tik \
    --batches 256 --prompt-len 136 --steps 16 --async-decode 2>&1 | tee "$OUT/prof_b256.log" | tail -24
fi
