#!/usr/bin/env bash
# On the device: join split wheels in DIR and install everything into /tmp/site.
#   bash bench/install_gpu_wheels.sh /tmp/w && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
dir=${1:-/tmp/w}
for first in "$dir"/*.whl.part.aa; do
  [ -e "$first" ] || continue
  whl=${first%.part.aa}
  cat "$whl".part.* > "$whl" && rm "$whl".part.*
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$dir"/*.whl
PYTHONPATH=/tmp/site:$PWD python3 -c "import areal, hydra, ray; from areal import PPOTrainer; print('areal', areal.__version__, 'imports')"
