"""bench/probes/probe_moe_grouped_tiles.py runs end to end at tiny widths on the CPU interpreter (a smoke run, so a
device call is not spent on a typo): every cell has both GEMMs, every timed tile's output equals the shipped tile's
bit for bit, the fused gate/up + SiLU-mul (``grouped_linear(..., silu=True)``) equals the GEMM + silu_mul_packed
pair bit for bit, and the routed-experts layer is timed with the shipped and the best tiles; bad counts are refused."""
import json
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [os.path.join(ROOT, "bench", "probes"), os.path.join(ROOT, "bench")]


def test_probe_runs_at_tiny_widths(tmp_path):
    import probe_moe_grouped_tiles as p
    assert p.main(["--out", str(tmp_path), "--tokens", "1,5", "--layers", "2", "--max-candidates", "2",
                   "--experts", "8", "--top-k", "2", "--hidden", "64", "--inter", "32",
                   "--extra-block-m", "32", "--extra-from-tokens", "5"]) == 0
    res = json.load(open(tmp_path / "moe_grouped_tiles.json"))
    assert [c["tokens"] for c in res["cells"]] == [1, 5]
    for c in res["cells"]:
        assert set(c["gemms"]) == {"gate_up", "down"}
        for gemm in c["gemms"].values():
            extra = c["tokens"] >= 5       # the larger block size's own plan, its tiles beside the shipped one's
            assert [r["block_m"] for r in gemm["rows"]] == [16] * 3 + [32] * 2 * extra
            assert gemm["all_bits_equal"] and gemm["shipped_us"] > 0
        assert c["layer_shipped_us"] > 0 and c["layer_best_us"] > 0
        fused = c["fused_gate_up_silu"]
        assert set(fused) == {"shipped", "best"} and all(v["bits_equal"] and v["us"] > 0 for v in fused.values())


def test_probe_refuses_bad_counts(tmp_path):
    import probe_moe_grouped_tiles as p
    with pytest.raises(SystemExit, match="must be >= 1"):
        p.main(["--out", str(tmp_path), "--tokens", "0"])
    with pytest.raises(SystemExit, match="--top-k at most"):
        p.main(["--out", str(tmp_path), "--experts", "4", "--top-k", "8"])


def test_probe_catches_a_tile_that_leaves_rows_unwritten(tmp_path, monkeypatch):
    """Negative control: a candidate tile whose launch writes nothing (its buffer keeps the poison) is reported
    unequal and never picked as the best tile."""
    import probe_moe_grouped_tiles as p
    from areal_tik.kernels.moe import grouped_linear as gl
    real = gl.grouped_linear
    broken = p.CANDIDATES[0]

    def grouped_linear(src, w, plan, row_div, out=None, splits=None, tile=None):
        if tile == broken and out is not None:
            return out                                   # nothing written
        return real(src, w, plan, row_div, out=out, splits=splits, tile=tile)
    monkeypatch.setattr(gl, "grouped_linear", grouped_linear)
    assert p.main(["--out", str(tmp_path), "--tokens", "3", "--layers", "1", "--max-candidates", "2",
                   "--experts", "8", "--top-k", "2", "--hidden", "64", "--inter", "32"]) == 0
    cell = json.load(open(tmp_path / "moe_grouped_tiles.json"))["cells"][0]
    for gemm in cell["gemms"].values():
        flags = [r["bits_equal_shipped"] for r in gemm["rows"]]
        assert flags == [True, False, True] and not gemm["all_bits_equal"]
        assert gemm["best"]["tile"] != broken
