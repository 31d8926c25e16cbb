"""bench/probes/probe_fa3_invariance.py on the CPU: without FA3 it says why and exits 2 (its rows need vLLM's FA3
on an sm_90 GPU; its inputs are ``reference.paged_case``, tested in tests/kernels/test_attention.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

PROBES = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "probes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-FA3 path")
def test_without_fa3_the_probe_says_why_and_exits_2(tmp_path):
    out = tmp_path / "inv.json"
    r = subprocess.run([sys.executable, os.path.join(PROBES, "probe_fa3_invariance.py"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.path.join(PROBES, "..", "..")})
    assert r.returncode == 2, r.stderr
    assert "FA3 unavailable: no CUDA GPU" in r.stdout
    assert json.loads(out.read_text()) == {"unavailable": "no CUDA GPU"}
