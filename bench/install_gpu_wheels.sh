#!/usr/bin/env bash
# On the device: join split wheels in DIR and install everything into /tmp/site.
#   bash bench/install_gpu_wheels.sh /tmp/w && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
dir=${1:-/tmp/w}
for first in "$dir"/*.part.aa; do  # wheels split for the carry limit (ray): NAME.whl.part.aa, .ab, ...
  [ -e "$first" ] || continue
  whl=${first%.part.aa}
  case "$whl" in *.whl) ;; *) echo "split part $first does not name a wheel (want <wheel file name>.whl.part.aa)"; exit 1 ;; esac
  cat "$whl".part.* > "$whl" && rm "$whl".part.*
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$dir"/*.whl
# the whole trainer path of bench/run_ab_gpu.sh (builtin data set; a real GSM8K run would also need
# math_verify for areal.reward.gsm8k, not carried). AReaL 1.0.4 pins transformers<=5.3.0: the carried
# 5.3.0 + tokenizers 0.22.2 + peft 0.18.1 shadow the image's newer ones on this PYTHONPATH)
PYTHONPATH=/tmp/site:$PWD python3 -c "
import areal, hydra, ray, transformers, tokenizers, peft
from areal import PPOTrainer
from areal.workflow.rlvr import RLVRWorkflow
from areal_tik.areal.trainer import TikPPOTrainer
print('areal', areal.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__,
      'peft', peft.__version__, 'ray', ray.__version__, 'imports')"
# The vLLM rollout server's view of this set: everything but the trainer's transformers pin (vLLM 0.24 needs
# transformers>=5.5.3, the image's 5.17; AReaL 1.0.4 pins <=5.3.0): actor.tik.server_pythonpath points there.
rm -rf /tmp/site-vllm && mkdir -p /tmp/site-vllm
for f in /tmp/site/*; do
  case "$(basename "$f")" in transformers|transformers-*|tokenizers|tokenizers-*|peft|peft-*) ;; *) ln -s "$f" /tmp/site-vllm/ ;; esac
done
