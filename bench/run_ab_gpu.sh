#!/usr/bin/env bash
# End-to-end A/B: AReaL 1.0.4's PPOTrainer, 1.5B recipes, through `areal-tik ab` (one
# `python -m areal_tik.areal.train` process per arm, SPMD world of one). Arms: vllm (stock vLLM through AReaL's
# vLLM server, recompute: the reference), tik (`areal-tik serve`, tik kernels, skip), vllm_tik (vLLM + the tik
# plugin, skip), baseline (`areal-tik serve` on default kernels, recompute: diagnostic; the reference without vLLM),
# vllm_loglinear (stock vLLM, no recompute: AReaL's actor.prox_logp_method=loglinear approximation; for the
# asynchronous recipe). SET (default vllm,tik,vllm_tik when vLLM is importable, else baseline,tik) names the compared
# arms, ARMS the ones this call runs (both/all, or a comma list, e.g. ARMS=vllm, then ARMS=tik, then ARMS=vllm_tik,
# one per call). RECIPES names recipes/<name>_qwen2.5-1.5b_gsm8k.yaml: grpo, ppo, grpo_async (asynchronous mode,
# rollout.max_head_offpolicyness 2, decoupled loss: the tik arms skip the recompute per sequence), or recipes/<name>.yaml
# (e.g. grpo_qwen3-moe-4l_arith, with MODEL=qwen3-30b-a3b-4l: the preset a run without real weights starts from).
# tik_ipc / vllm_tik_ipc: tik / vllm_tik with the weights handed over through a shared buffer on the trainer's GPU
# (actor.tik.weight_transfer=ipc) instead of AReaL's disk round trip (one GPU: disk mode).
# The asynchronous A/B (one arm per call, the same warm machine; step throughput, fraction of sequences skipped,
# reward ratio with its 95% CI and audit counts are in ab_grpo_async_summary.md):
#   RECIPES=grpo_async SET=vllm,vllm_loglinear,tik,vllm_tik ARMS=vllm BUDGET_S=520 STEPS=10 WARMSTART_STEPS=300 \
#     GEN_TOKENS=256 bash bench/run_ab_gpu.sh        (then ARMS=vllm_loglinear, ARMS=tik, ARMS=vllm_tik)
#   (one H100, 6 steps at the recipe's 32 prompts x 8: the vllm arm ran 262 s, 185 s of it start-up; tik 131 s;
#   vllm_loglinear 161 s; the first call, with both wheel installs and the 63 s warm start, 463 s)
# vLLM arms on one H200: install vLLM's wheels into /tmp/vsite (../shared/vllm/README.md: fetch.sh here,
# install.sh there) besides AReaL's in /tmp/site; disk weight updates; the server gets VLLM_MEM (0.35) of the GPU.
# vLLM's HTTP server needs three small wheels beyond the vllm.LLM kit (bench/fetch_vllm_server_wheels.sh ->
# .whl-vllm/srv: carry it with a kit part, e.g. run(carry=[".whl-vllm/p7", ".whl-vllm/srv"])), and its own
# PYTHONPATH without AReaL's transformers pin: install_gpu_wheels.sh makes /tmp/site-vllm and this script passes
# actor.tik.server_pythonpath=REPO:/tmp/vsite:/tmp/site-vllm. Check the servers alone first (~3 min):
#   PYTHONPATH=$PWD:/tmp/vsite:/tmp/site python bench/probes/probe_vllm_server.py --out $OUT/probe \
#     --server-pythonpath $PWD:/tmp/vsite:/tmp/site-vllm
#
# Device (no areal/hydra/ray there, no network): carry the wheels first (bench/fetch_gpu_wheels.sh
# says how: .whl/p1..p3, three calls), install them with bench/install_gpu_wheels.sh /tmp/w (into
# /tmp/site; this script puts /tmp/site and the repo on PYTHONPATH), then one call per recipe and arm.
# Each arm spends ~100 s starting (process, AReaL init, rollout server, model build) and step 0
# takes ~40 s at 1.5B, so 10 steps of both arms do not fit one 600 s call: run one arm per call
# (ARMS=baseline, then ARMS=tik; the report is written by the call that completes the pair; the
# arms meet in AB_OUT, default /tmp/areal_tik_ab_reports, which survives while the machine is warm).
# On one nvidia-h200-x2 (trainer on GPU 0, server on GPU 1, weights by xccl as in AReaL's default), calls back to
# back with timeout_s=600 (a machine that went cold loses /tmp/w, /tmp/site and AB_OUT: start again at 1). Check each
# command's own exit status before the next one (`a | tail && b` runs b whatever a did):
#   1. carry [.whl/p1]: mkdir -p /tmp/w && cp .whl/p1/* /tmp/w/
#   2. carry [.whl/p2]: cp .whl/p2/* /tmp/w/
#   3. carry [.whl/p3]: cp .whl/p3/* /tmp/w/ && bash bench/install_gpu_wheels.sh /tmp/w && \
#        PROFILE_STEP=10 BUDGET_S=500 STEPS=11 GEN_TOKENS=256 \
#        EXTRA_OVERRIDES=train_dataset.batch_size=16 RECIPES=grpo ARMS=both bash bench/run_ab_gpu.sh
#        (step 10 of each arm under torch.profiler -> <arm>/profile_step10.txt, left out of the ratios;
#        every step logs the Triton compiles of the trainer and the server)
#   then, on the same warm machine, PPO at 16 prompts or at the recipe's 128:
#     PROFILE_STEP=10 BUDGET_S=420 STEPS=11 GEN_TOKENS=256 EXTRA_OVERRIDES=train_dataset.batch_size=16 RECIPES=ppo ARMS=both
#     PROFILE_STEP=10 BUDGET_S=520 STEPS=11 GEN_TOKENS=256 RECIPES=ppo ARMS=both   (541 s: a whole call;
#       both arms at 128 prompts spend ~125-145 s outside the logged steps)
#   and the reward comparison from a warm-started model (a warm-started 1.5B answers in a few tokens: cheap steps;
#   the summary gives the reward ratio's 95% CI):
#     BUDGET_S=520 STEPS=10 WARMSTART_STEPS=300 GEN_TOKENS=32 RECIPES=grpo ARMS=both
#   The figures these gave: docs/results.md, "AReaL A/B".
# (One nvidia-h200, disk mode: ~85 s start-up + ~42 s step 0 per arm, ~15 s per later step at 16 prompts x 8
# samples x 256 tokens, 8 s of it AReaL's save-to-disk weight update. The vllm arm: 240 s for 3 steps, i.e. ~175 s
# of AReaL init + vLLM server start (torch.compile, graph capture) + 28 s step 0 + ~12 s per later step, of which
# the disk update ~8 s. A fresh machine needs the vLLM kit's eight parts + .whl-vllm/srv and AReaL's three: eleven
# carry calls, ~60 s of device time.)
# Every call packs what AB_OUT holds for the recipe ($OUT/ab_<recipe>.tgz), so a lost machine
# still leaves the finished arm here; `areal-tik ab --config ... --out DIR --arms none` rebuilds
# the report from two unpacked arms.
# then here: python bench/collect_results.py <files_at> --command "..." --label ab-<recipe> (keeps summary.md,
# report.json, steps.csv and the figures; bench/README.md), and commit.
# CPU dry run of this whole path: SMOKE=1 bash bench/run_ab_gpu.sh (tests/bench/test_bench_run_ab_gpu.py). DRY_RUN=1 prints
# each recipe's shared overrides as JSON and exits (tests/ab/test_ab_overrides_compose.py composes every arm's config).
# A device call is killed at 600 s: BUDGET_S (default 540) is split over the arms as per-arm
# timeouts; an arm that runs out keeps the steps it logged (--partial-ok; the tik arm then runs
# as many steps as the baseline logged) and the summary says PARTIAL. With $OUT set (the device's
# result folder, <= 8 files) each recipe's report dir is packed into $OUT/ab_<recipe>.tgz plus
# $OUT/ab_<recipe>_summary.md; AReaL's fileroot (model dirs, weight-update checkpoints, GBs
# at 1.5B) goes to RUNS_DIR (default /tmp/areal_tik_ab_runs), never into $OUT.
#
# Without the Qwen weights/tokenizer/GSM8K on the device the recipes run on the preset
# qwen2.5-1.5b (random init, exact shapes), the shipped char tokenizer and the generated 'mix'
# arithmetic set: throughput (not reward) is what this measures then. A random model never
# emits EOS, so every sample runs to gconfig.max_new_tokens (GEN_TOKENS, default 512).
# QWEN_DIR=<local HF dir> uses real weights + tokenizer instead.
#
# Env knobs: RECIPES ("grpo ppo"), MODEL (the preset without real weights, default qwen2.5-1.5b), SET (see above), ARMS (both | all | comma list of SET's arms), STEPS (10), BUDGET_S (540),
# VLLM_MEM (vllm.gpu_memory_utilization when the vLLM server shares the trainer's GPU, default 0.35),
# VLLM_SKIP_TOKENIZER (1 with the char tokenizer: vllm.skip_tokenizer_init=true),
# WEIGHT_UPDATE (xccl when the server has its own GPU, else disk), WARMSTART_STEPS (0; N > 0: first
# `areal-tik warmstart` the preset on the arithmetic task for N steps into WARM_DIR and run both arms
# from it, so the reward is not 0: use with a small GEN_TOKENS, e.g. 32, the answers are short),
# ARM_TIMEOUT (BUDGET_S split over the arms run in this call),
# GEN_TOKENS (512), AB_OUT (report root, default /tmp/areal_tik_ab_reports), RUNS_DIR,
# EXTRA_OVERRIDES (whitespace-separated AReaL overrides appended last, e.g.
# "train_dataset.batch_size=16 actor.tik.audit_interval=5"; Hydra: quote values holding
# ?/= like "train_dataset.path='builtin:arith/mix?n=64'"), SMOKE=1 (CPU-size dry run of this
# very path: preset tiny-qwen2, 16 new tokens, batch 2, 2 steps; ~45 s per recipe on a CPU).
# Layout: trainer on GPU 0; rollout server on GPU 1 when >= 2 GPUs are visible
# (SERVER_DEVICE, passed as actor.tik.server_device; set it yourself to override), weights sent by xccl
# (AReaL's default)
# there, by disk on one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
# PYTHONPATH: the repo, then vLLM's wheels (/tmp/vsite, when installed), then AReaL's (/tmp/site). Both sets hold
# pydantic, openai and starlette; the vLLM kit's copies win because they are the set vLLM's OpenAI server was
# resolved with (fastapi 0.136.3 + starlette 1.3.1, openai 2.44 whose types the server imports, pydantic 2.13.4 with
# its own pydantic-core: each dir holds a matching pydantic/pydantic-core pair, so the pair stays consistent).
# AReaL's trainer path imports none of openai/fastapi/starlette (only its agent workflows do) and runs on either
# pydantic. vLLM's server process and its workers inherit this environment.
PYPATH="$REPO"
[ -d /tmp/vsite ] && PYPATH="$PYPATH:/tmp/vsite" && export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
[ -d /tmp/site ] && PYPATH="$PYPATH:/tmp/site"
export PYTHONPATH="$PYPATH${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
RECIPES=${RECIPES:-grpo ppo}
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then STEPS=${STEPS:-2}; else STEPS=${STEPS:-10}; fi
BUDGET_S=${BUDGET_S:-540}
read -r -a RECIPE_LIST <<< "$RECIPES"
# the compared arms: stock vLLM as the reference when vLLM is importable, else our engine on default kernels
if [ -z "${SET:-}" ]; then
  if python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then SET=vllm,tik,vllm_tik
  else SET=baseline,tik; fi
fi
ARMS=${ARMS:-both}
case "$ARMS" in both|all) RUN_ARMS=$SET ;; *) RUN_ARMS=$ARMS ;; esac
IFS=, read -r -a RUN_LIST <<< "$RUN_ARMS"
IFS=, read -r -a SET_LIST <<< "$SET"
for a in "${RUN_LIST[@]}"; do
  case ",$SET," in *",$a,"*) ;; *) echo "ARMS: '$a' is not in SET=$SET (arms: vllm, vllm_loglinear, baseline, tik, tik_ipc, vllm_tik, vllm_tik_ipc)"; exit 2 ;; esac
done
NARMS=${#RUN_LIST[@]}
[ "${DRY_RUN:-0}" = 1 ] || case ",$RUN_ARMS," in *,vllm_tik,*|*,vllm_tik_ipc,*)  # vLLM finds the tik plugin only through its entry point (bench/install_vllm_wheels.sh)
  python3 -c "import importlib.metadata as md, sys; sys.exit(not any(e.name == 'areal_tik' for e in md.entry_points(group='vllm.general_plugins')))" \
    || { echo "the vllm_tik arm needs the tik plugin's vllm.general_plugins entry point: run bench/install_vllm_wheels.sh"; exit 2; } ;;
esac
REF=$(python3 -c "import sys; a='$SET'.split(','); print(next(x for x in ('vllm','baseline','vllm_loglinear','tik','tik_ipc','vllm_tik','vllm_tik_ipc') if x in a))")
ARM_TIMEOUT=${ARM_TIMEOUT:-$(( (BUDGET_S - 20) / (NARMS * ${#RECIPE_LIST[@]}) ))}
AB_OUT=${AB_OUT:-/tmp/areal_tik_ab_reports}
RUNS_DIR=${RUNS_DIR:-/tmp/areal_tik_ab_runs}
GEN_TOKENS=${GEN_TOKENS:-512}
read -r -a EXTRA <<< "${EXTRA_OVERRIDES:-}"
mkdir -p "$AB_OUT"

NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ -z "${SERVER_DEVICE:-}" ] && [ "$NGPU" -ge 2 ]; then SERVER_DEVICE=cuda:1; fi
# AReaL's default weight transfer is xccl (NCCL broadcast trainer -> server), which needs the server on
# its own GPU; on one GPU (trainer and server colocated) AReaL itself requires disk.
case "${SERVER_DEVICE:-cuda}" in cuda|cuda:0) WU_DEFAULT=disk ;; *) WU_DEFAULT=xccl ;; esac
[ "$NGPU" -ge 1 ] || WU_DEFAULT=disk
WEIGHT_UPDATE=${WEIGHT_UPDATE:-$WU_DEFAULT}
echo "run_ab_gpu: recipes=[$RECIPES] arms=$RUN_ARMS of set=$SET (reference $REF) steps=$STEPS smoke=$SMOKE gpus=$NGPU server_device=${SERVER_DEVICE:-default} weight_update=$WEIGHT_UPDATE" \
     "arm_timeout=${ARM_TIMEOUT}s out=$AB_OUT runs=$RUNS_DIR"

if [ "${WARMSTART_STEPS:-0}" -gt 0 ]; then  # a preset that earns reward: the A/B's reward comparison
  WARM_DIR=${WARM_DIR:-/tmp/areal_tik_warm}
  # one arm per call on a warm machine: the later calls reuse the earlier call's warm start (same model, steps, lr)
  STAMP="${WARM_MODEL:-qwen2.5-1.5b} steps=$WARMSTART_STEPS lr=${WARMSTART_LR:-3e-4}"
  if [ -f "$WARM_DIR/config.json" ] && [ "$(cat "$WARM_DIR/.warmstart_stamp" 2>/dev/null)" = "$STAMP" ]; then
    echo "run_ab_gpu: reusing the warm start in $WARM_DIR ($STAMP)"
  else
    python3 -m areal_tik.cli warmstart --model "${WARM_MODEL:-qwen2.5-1.5b}" --task mix --steps "$WARMSTART_STEPS" \
        --lr "${WARMSTART_LR:-3e-4}" --out "$WARM_DIR" --no-progress | tee "$AB_OUT/warmstart.json"
    [ "${PIPESTATUS[0]}" -eq 0 ] && echo "$STAMP" > "$WARM_DIR/.warmstart_stamp"
  fi
  QWEN_DIR=$WARM_DIR
fi
if [ -n "${QWEN_DIR:-}" ]; then  # real weights + tokenizer available locally (or the warm start)
  DATA=(actor.path="$QWEN_DIR" tokenizer_path="$QWEN_DIR" "train_dataset.path='builtin:arith/mix?n=8192'")
else
  DATA=(actor.path=preset:${MODEL:-qwen2.5-1.5b} tokenizer_path=builtin:tiny-char "train_dataset.path='builtin:arith/mix?n=8192'")
fi
SIZE=(gconfig.max_new_tokens="$GEN_TOKENS" gconfig.max_tokens=$(( GEN_TOKENS + 512 )) rollout.setup_timeout=900
      actor.tik.audit_interval=5 actor.weight_update_mode="$WEIGHT_UPDATE")
SETTINGS=()   # Settings for every arm (actor.tik.*): the server's device, the profiled step
[ -n "${SERVER_DEVICE:-}" ] && SETTINGS+=(actor.tik.server_device="$SERVER_DEVICE")
[ -n "${PROFILE_STEP:-}" ] && SETTINGS+=(actor.tik.profile_step="$PROFILE_STEP")
# a vLLM server on the trainer's GPU must leave it room: VLLM_MEM of the GPU (AReaL's default 0.9 on its own GPU)
case "${SERVER_DEVICE:-cuda}" in cuda|cuda:0) VLLM_MEM=${VLLM_MEM:-0.35} ;; *) VLLM_MEM=${VLLM_MEM:-} ;; esac
# The shipped char tokenizer covers a few dozen ids of the preset's 151,936: vLLM must not detokenize what a random
# (or warm-started) preset samples. AReaL's vLLM client sends and reads token ids only, so VLLM_SKIP_TOKENIZER=1
# (the default with the char tokenizer) passes vllm.skip_tokenizer_init=true to both vLLM arms.
if [ -z "${QWEN_DIR:-}" ] || [ "${WARMSTART_STEPS:-0}" -gt 0 ]; then VLLM_SKIP_TOKENIZER=${VLLM_SKIP_TOKENIZER:-1}; fi
case ",$SET," in
  *,vllm,*|*,vllm_tik,*|*,vllm_tik_ipc,*|*,vllm_loglinear,*)
    [ -n "$VLLM_MEM" ] && SETTINGS+=(vllm.gpu_memory_utilization="$VLLM_MEM")
    # vLLM 0.24 needs transformers>=5.5.3 (the image's 5.17); AReaL's set pins 5.3.0 for the trainer: the server
    # gets /tmp/site-vllm, AReaL's set without transformers/tokenizers/peft (bench/install_gpu_wheels.sh makes it)
    [ -d /tmp/site-vllm ] && SETTINGS+=("actor.tik.server_pythonpath='$REPO:/tmp/vsite:/tmp/site-vllm'")
    [ "${VLLM_SKIP_TOKENIZER:-0}" = 1 ] && SETTINGS+=(vllm.skip_tokenizer_init=true) ;;
esac
if [ "$SMOKE" = 1 ]; then
  DATA=(actor.path=preset:tiny-qwen2 tokenizer_path=builtin:tiny-char "train_dataset.path='builtin:arith/mix?n=64'")
  SIZE=(gconfig.max_new_tokens=16 gconfig.max_tokens=64 gconfig.n_samples=2 train_dataset.batch_size=2
        train_dataset.max_length=64 sglang.context_length=64 actor.mb_spec.max_tokens_per_mb=4096
        actor.ppo_n_minibatches=1 actor.tik.audit_interval=5 actor.weight_update_mode="$WEIGHT_UPDATE")
fi

recipe_file() {  # recipes/<name>.yaml when it exists, else the 1.5B recipe recipes/<name>_qwen2.5-1.5b_gsm8k.yaml
  if [ -f "recipes/$1.yaml" ]; then echo "recipes/$1.yaml"; else echo "recipes/$1_qwen2.5-1.5b_gsm8k.yaml"; fi
}
if [ "${DRY_RUN:-0}" = 1 ]; then  # the overrides every arm gets, one JSON list per recipe (tests compose them on a CPU)
  for RECIPE in "${RECIPE_LIST[@]}"; do
    python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$(recipe_file "$RECIPE")" \
      "${DATA[@]}" "${SIZE[@]}" "${SETTINGS[@]+"${SETTINGS[@]}"}" "${EXTRA[@]+"${EXTRA[@]}"}"
  done
  exit 0
fi
python3 -m areal_tik.cli env --json > "$AB_OUT/env.json" 2> "$AB_OUT/env.err" || echo "areal-tik env failed (see $AB_OUT/env.err)"

pack() {  # the device returns at most 8 files from $OUT: one archive + one summary per recipe
  [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] || return 0
  [ "$(cd "$AB_OUT" && pwd)" = "$(cd "$OUT" && pwd)" ] && return 0
  for R in "${RECIPE_LIST[@]}"; do
    [ -d "$AB_OUT/$R" ] || continue
    tar czf "$OUT/ab_$R.tgz" -C "$AB_OUT" "$R" env.json $(cd "$AB_OUT" && ls warmstart.json 2>/dev/null) 2>/dev/null || true
    [ -f "$AB_OUT/$R/summary.md" ] && cp "$AB_OUT/$R/summary.md" "$OUT/ab_${R}_summary.md"
  done
  echo "packed into $OUT: $(ls "$OUT" | tr '\n' ' ')"
}
trap pack EXIT

status=0
for RECIPE in "${RECIPE_LIST[@]}"; do
  CFG=$(recipe_file "$RECIPE")
  [ -f "$CFG" ] || { echo "no recipe $CFG"; status=1; continue; }
  PER=()
  if [ "$SMOKE" = 1 ] && [ "$RECIPE" = ppo ]; then
    PER=(critic.mb_spec.max_tokens_per_mb=4096 critic.ppo_n_minibatches=1)
  fi
  # a call that runs the reference arm starts a new set; any other call replaces only the arms it runs
  case ",$RUN_ARMS," in
    *",$REF,"*) rm -rf "${AB_OUT:?}/$RECIPE" ;;
    *) for a in "${RUN_LIST[@]}"; do rm -rf "${AB_OUT:?}/$RECIPE/$a"; done ;;
  esac
  rm -rf "${RUNS_DIR:?}" && mkdir -p "$AB_OUT/$RECIPE"
  set +e
  python3 -m areal_tik.cli ab --config "$CFG" --steps "$STEPS" --out "$AB_OUT/$RECIPE" --runs-dir "$RUNS_DIR" \
      --timeout "$ARM_TIMEOUT" --partial-ok --no-progress --set "$SET" --arms "$RUN_ARMS" \
      "${DATA[@]}" "${SIZE[@]}" "${SETTINGS[@]+"${SETTINGS[@]}"}" "${PER[@]+"${PER[@]}"}" "${EXTRA[@]+"${EXTRA[@]}"}" 2>&1 | tee -a "$AB_OUT/$RECIPE/ab_stdout.txt"
  rc=${PIPESTATUS[0]}
  set -e
  echo "== $RECIPE A/B exit $rc"
  [ "$rc" -eq 0 ] || status=1
  rm -rf "${RUNS_DIR:?}"  # GBs of model dirs at 1.5B; the tik server log was copied into the report
done
exit $status
