#!/usr/bin/env bash
# Install areal-tik and what it needs on a fresh machine.
#   bash install.sh          package + CPU/GPU runtime deps + AReaL (for the plugin and the A/B job)
#   bash install.sh test     the same plus the test tools
# AReaL 1.0.4 pins torch<2.11, so it goes in with --no-deps plus the packages it really
# imports, under a torch==2.13.0 constraint (otherwise pip pulls a 9 GB CUDA stack).
set -euo pipefail
cd "$(dirname "$0")"
PIP="python -m pip install -q --disable-pip-version-check"
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # GPU machine: keep the torch/triton that are there.
  $PIP -r requirements/gpu.txt
else
  $PIP -r requirements/cpu.txt
fi
$PIP -c requirements/constraints.txt -r requirements/areal.txt
$PIP --no-deps areal==1.0.4
$PIP --no-build-isolation -e .
if [ "${1:-}" = "test" ]; then $PIP pytest hypothesis; fi
python -c "import areal_tik, areal; print('areal-tik', areal_tik.__version__, 'installed; areal', areal.__version__)"
