# Sourced by the device jobs (bench/run_*_check.sh, run_7b_round.sh): the repository root, the path, $OUT (default
# $1), the GPU's clocks and name in $OUT/smi.txt, and the csrc extension built before anything is timed.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-$1}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/smi.txt" 2>&1
timeout 400 python -c "from areal_tik.kernels.cuda import loader as cuda_ext; print('csrc', cuda_ext.status()[0])" 2>&1 | tail -1
