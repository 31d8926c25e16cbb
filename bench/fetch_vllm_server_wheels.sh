#!/usr/bin/env bash
# Run HERE (a machine with PyPI): the small wheels vLLM's HTTP server needs beyond ../shared/vllm's kit
# (requirements/gpu_vllm_server_wheels.txt) into .whl-vllm/srv (ignored by git, < 1 MiB). On the device, carry it
# with one of the kit's parts: run(carry=[".whl-vllm/p7", ".whl-vllm/srv"]): cp .whl-vllm/p7/* .whl-vllm/srv/* /tmp/vw/
# (bench/install_vllm_wheels.sh installs every wheel in /tmp/vw).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl-vllm/srv && mkdir -p .whl-vllm/srv
grep -v '^#' requirements/gpu_vllm_server_wheels.txt | while read -r spec; do
  [ -z "$spec" ] && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl-vllm/srv "$spec"
done
ls .whl-vllm/srv
