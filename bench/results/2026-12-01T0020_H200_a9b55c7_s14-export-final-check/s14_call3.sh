#!/usr/bin/env bash
# Session 14, call 3: the cuda-backend GPU suite with the rms_norm export registered, the export's GPU test,
# verify with the defaults and with rms_norm/apply_rope on the cuda backend.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=$OUT/stage; mkdir -p $S
rm -f areal_tik/_C*.so
t0=$(date +%s)
timeout 330 python -m pytest -q -rfE -m gpu -p no:cacheprovider --timeout=300 tests/kernels/test_cuda_backend.py \
  tests/engine/test_graph_capture.py tests/agent/test_csrc_root.py::test_rms_export_runs_the_version_gpu \
  > $S/gpu_tests.log 2>&1; tail -4 $S/gpu_tests.log
echo "tests $(( $(date +%s) - t0 )) s"
V="python -m areal_tik.cli verify --model qwen2.5-1.5b --prompts 16 --max-prompt-len 300 --max-new-tokens 64 --json"
timeout 120 $V > $S/verify.json 2> $S/verify.err; echo "verify rc $?"
echo "verify $(( $(date +%s) - t0 )) s"
AREAL_TIK_BACKEND="rms_norm=cuda,apply_rope=cuda" timeout 140 $V > $S/verify_cuda_ew.json 2> $S/verify_cuda_ew.err; echo "verify cuda-ew rc $?"
python - <<'PY'
import json, os
for f in ("verify.json", "verify_cuda_ew.json"):
    try:
        d = json.load(open(os.path.join(os.environ["OUT"], "stage", f)))
        print(f, "n_mismatch_total", d.get("n_mismatch_total"), {k: v.get("passed") for k, v in d.get("regimes", {}).items()},
              d.get("fingerprint", {}).get("backends") if isinstance(d.get("fingerprint"), dict) else "")
    except Exception as e:
        print(f, "unreadable", e)
PY
echo "total $(( $(date +%s) - t0 )) s"
tar czf $OUT/s14_call3.tgz -C $S .
