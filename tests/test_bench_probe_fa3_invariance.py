"""bench/probes/probe_fa3_invariance.py on the CPU: its input builder puts every sequence's keys on its pages and
poisons only the unused slots, and without FA3 it says why and exits 2 (its GPU rows need vLLM's FA3)."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

PROBES = os.path.join(os.path.dirname(__file__), "..", "bench", "probes")
sys.path.insert(0, PROBES)

import probe_fa3_invariance as p  # noqa: E402


@pytest.mark.parametrize("page", [16, 128])
def test_inputs_place_each_sequence_on_its_pages_and_poison_only_unused_slots(monkeypatch, page):
    monkeypatch.setattr(torch.Tensor, "cuda", lambda t: t)     # the probe moves its inputs to the GPU
    lens = [40, 7, 130]
    q, k, v, kc, vc, table, cu, sk = p.inputs(lens, page, 64, 4, 2, float("nan"))
    used = 0
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[i].long()[pos // page] * page + pos % page
        s0 = int(cu[i])
        assert torch.equal(kc.view(-1, 2, 64)[slots], k[s0:s0 + n])
        assert torch.equal(vc.view(-1, 2, 64)[slots], v[s0:s0 + n])
        used += n
    assert int(kc.isnan().any(-1).any(-1).sum()) == kc.shape[0] * page - used   # every other slot is poisoned
    assert sk.tolist() == lens and not math.isnan(float(q.float().sum()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-FA3 path")
def test_without_fa3_the_probe_says_why_and_exits_2(tmp_path):
    out = tmp_path / "inv.json"
    r = subprocess.run([sys.executable, os.path.join(PROBES, "probe_fa3_invariance.py"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.path.join(PROBES, "..", "..")})
    assert r.returncode == 2, r.stderr
    assert "FA3 unavailable: no CUDA GPU" in r.stdout
    assert json.loads(out.read_text()) == {"unavailable": "no CUDA GPU"}
