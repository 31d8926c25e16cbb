#!/usr/bin/env bash
# On the GPU machine: install vLLM 0.24's wheels (copied to /tmp/vw by the carry calls of
# ../shared/vllm/README.md: fetch.sh splits them into .whl-vllm/p1..pN here) into /tmp/vsite, and declare the tik
# plugin's `vllm.general_plugins` entry point there (what `pip install 'areal-tik[vllm]'` declares; the repo itself
# travels as a plain PYTHONPATH entry, which has no entry points). Idempotent.
#   bash bench/install_vllm_wheels.sh [/tmp/vw] [/tmp/vsite]
set -euo pipefail
W=${1:-/tmp/vw}
SITE=${2:-/tmp/vsite}
if [ ! -d "$SITE/vllm" ]; then
  if ls "$W"/vllm-*.part.* >/dev/null 2>&1; then
    cat "$W"/vllm-*.part.* > "$W/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl" && rm "$W"/vllm-*.part.*
  fi
  ls "$W"/vllm-*.whl >/dev/null || { echo "no vLLM wheel (or parts) in $W"; exit 1; }
  timeout 300 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$W"/*.whl
fi
D="$SITE/areal_tik-0.1.0.dist-info"
mkdir -p "$D"
printf 'Metadata-Version: 2.1\nName: areal-tik\nVersion: 0.1.0\n' > "$D/METADATA"
printf '[vllm.general_plugins]\nareal_tik = areal_tik.vllm_plugin.register:register\n' > "$D/entry_points.txt"
echo "vLLM in $SITE; tik plugin entry point declared in $D"
