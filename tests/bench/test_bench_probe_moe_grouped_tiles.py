"""bench/probes/probe_moe_grouped_tiles.py runs end to end at tiny widths on the CPU interpreter (a smoke run, so a
device call is not spent on a typo): every cell has both GEMMs, every timed tile's output equals the shipped tile's
bit for bit, and the routed-experts layer is timed with the shipped and the best tiles; bad counts are refused."""
import json
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [os.path.join(ROOT, "bench", "probes"), os.path.join(ROOT, "bench")]


def test_probe_runs_at_tiny_widths(tmp_path):
    import probe_moe_grouped_tiles as p
    assert p.main(["--out", str(tmp_path), "--tokens", "1,5", "--layers", "2", "--max-candidates", "2",
                   "--experts", "8", "--top-k", "2", "--hidden", "64", "--inter", "32"]) == 0
    res = json.load(open(tmp_path / "moe_grouped_tiles.json"))
    assert [c["tokens"] for c in res["cells"]] == [1, 5]
    for c in res["cells"]:
        assert set(c["gemms"]) == {"gate_up", "down"}
        for gemm in c["gemms"].values():
            assert len(gemm["rows"]) == 3 and gemm["all_bits_equal"] and gemm["shipped_us"] > 0
        assert c["layer_shipped_us"] > 0 and c["layer_best_us"] > 0


def test_probe_refuses_bad_counts(tmp_path):
    import probe_moe_grouped_tiles as p
    with pytest.raises(SystemExit, match="must be >= 1"):
        p.main(["--out", str(tmp_path), "--tokens", "0"])
    with pytest.raises(SystemExit, match="--top-k at most"):
        p.main(["--out", str(tmp_path), "--experts", "4", "--top-k", "8"])
