#!/usr/bin/env bash
# Run HERE (a machine with PyPI): download the cp312 wheels the GPU image lacks for running
# AReaL 1.0.4's trainer with the plugin, split into parts of < 45 MiB for the device's
# 64 MiB-per-call carry limit (ray alone is ~79 MiB).
#   bash bench/fetch_gpu_wheels.sh  ->  .whl/p1 .whl/p2 .whl/p3   (ignored by git)
# Then, back to back while the machine is warm (it is kept 30 s after a call):
#   run(carry=[".whl/p1"]): mkdir -p /tmp/w && cp .whl/p1/* /tmp/w/
#   run(carry=[".whl/p2"]): cp .whl/p2/* /tmp/w/
#   run(carry=[".whl/p3"]): cp .whl/p3/* /tmp/w/ && bash bench/install_gpu_wheels.sh /tmp/w && <the job>
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
tmp=$(mktemp -d)
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64)
while read -r spec; do
  [ -z "$spec" ] || [ "${spec:0:1}" = "#" ] && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLAT[@]}" -d "$tmp" "$spec"
done < requirements/gpu_areal_wheels.txt
rm -rf .whl && mkdir -p .whl/p1 .whl/p2 .whl/p3
ray=$(ls "$tmp"/ray-*.whl)
split -b 42m "$ray" .whl/p1/"$(basename "$ray")".part.
mv .whl/p1/*.part.ab .whl/p2/
rm "$ray"
mv "$tmp"/wandb-*.whl .whl/p2/
mv "$tmp"/*.whl .whl/p3/
du -sh .whl/*
