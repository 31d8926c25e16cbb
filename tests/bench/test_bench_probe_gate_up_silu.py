"""bench/probes/probe_gate_up_silu.py runs end to end at tiny widths on the CPU interpreter (a smoke run, so a device
call is not spent on a typo): every forced config's fused launch, with its N tile halved and kept, equals the two ops
apart bit for bit, and the apart pair, cuBLAS's stand-in and the fused launches all get a time."""
import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [os.path.join(ROOT, "bench", "probes"), os.path.join(ROOT, "bench")]


def test_probe_runs_at_tiny_widths(tmp_path):
    import probe_gate_up_silu as p
    assert p.main(["--out", str(tmp_path), "--shape", "64x48", "--ms", "3", "--budget-s", "600"]) == 0
    res = json.load(open(tmp_path / "gate_up_silu.json"))
    (cell,) = res["cells"]
    assert (cell["M"], cell["H"], cell["I"]) == (3, 64, 48)
    assert cell["apart_us"] > 0 and cell["cublas_torch_us"] > 0 and not cell["invalid"]
    fused = cell["fused"]
    assert any(k.startswith("pick:") for k in fused) and any(k.endswith("/x2") for k in fused)
    assert all(v["bits_equal"] and v["us"] > 0 for v in fused.values())
    assert fused["dec16_n64"]["fused_block_n"] == 32 and fused["dec16_n64/x2"]["fused_block_n"] == 64
