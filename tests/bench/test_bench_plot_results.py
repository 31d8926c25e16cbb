"""bench/plot_results.py on the CPU: each JSON kind becomes a PNG beside it, and a result missing a key it
plots is an error (never a bar drawn at zero)."""
import json
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import plot_results  # noqa: E402


def _png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_cuda_and_bisect_figures(tmp_path):
    bc = {"gpu": "G", "torch": "t",
          "prefill": [{"L": 1024, "sdpa_ms": 1.0, "cuda_ms": 1.25, "cuda_mma_ms": 2.5, "triton_ms": 2.0}],
          "decode": [{"batch": 1, "ctx": 128, "sdpa_ms": 0.01, "cuda_ms": 0.005, "triton_ms": 0.006,
                      "floor_us_at_4.1TBps": 0.2},
                     {"batch": 16, "ctx": 8192, "sdpa_ms": 0.12, "cuda_ms": 0.14, "triton_ms": 0.15,
                      "floor_us_at_4.1TBps": 131.0}]}
    p = tmp_path / "bench_cuda.json"
    p.write_text(json.dumps(bc))
    assert _png(plot_results.plot_bench_cuda(str(p)))
    bc["train_attention"] = [{"batch": 16, "L": 1024, "hq": 12, "hkv": 2, "sdpa_fwd_bwd_ms": 0.6,
                              "cuda_fwd_bwd_ms": 0.95, "cuda_tritonbwd_fwd_bwd_ms": 1.3, "triton_fwd_bwd_ms": 1.0}]
    p.write_text(json.dumps(bc))
    assert _png(plot_results.plot_bench_cuda(str(p)))
    del bc["train_attention"][0]["cuda_fwd_bwd_ms"]
    p.write_text(json.dumps(bc))
    with pytest.raises(KeyError):
        plot_results.plot_bench_cuda(str(p))
    pre = [{"H_varlen": True}, {"L": 512, "batch": 64, "heads": "12/2", "page_size": 64, "sdpa": 360.0,
                                "H_eq": True, "H": [195.0, 196.0], "X_eq": False, "X": [210.0, 211.0]}]
    dec = [{"H_cpc0_ps64_fused": True}, {"batch": 1, "ctx": 550, "heads": "12/2", "sdpa_us": 7.9,
                                         "H_cpc0_eq": True, "H_cpc0": [9.3, 9.2], "S_cpc0_eq": False,
                                         "S_cpc0": [12.6, 12.6]}]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bisect.json").write_text(json.dumps(pre))
    (tmp_path / "b" / "bisect_decode.json").write_text(json.dumps(dec))
    assert plot_results.main([str(tmp_path / "b" / "bisect.json"), str(tmp_path / "b" / "bisect_decode.json")]) == 0
    assert _png(tmp_path / "b" / "bisect.png") and _png(tmp_path / "b" / "bisect_decode.png")


def test_missing_key_is_an_error(tmp_path):
    p = tmp_path / "bench_cuda.json"
    p.write_text(json.dumps({"gpu": "G", "torch": "t", "prefill": [{"L": 1024, "sdpa_ms": 1.0}], "decode": []}))
    with pytest.raises(KeyError):
        plot_results.plot_bench_cuda(str(p))


def test_ceiling_bound_and_figure(tmp_path):
    import bench_ceiling
    l2 = 50 << 20
    # an L2-sized cell is bounded by the launch floor only; an HBM cell by its read time when that is longer
    assert bench_ceiling.cell_bound_us(16 << 20, 2.5, 4e12, l2) == 2.5
    big = 537 << 20
    assert bench_ceiling.cell_bound_us(big, 2.5, 4e12, l2) == pytest.approx(big / 4e12 * 1e6)
    assert bench_ceiling.cell_bound_us(big, 1e6, 4e12, l2) == 1e6
    d = {"gpu": "G", "launch_floor_us": 2.5, "read": {"read_ceiling_Bps": 4.4e12}, "spec_hbm_Bps": 4.8e12,
         "decode": [{"batch": 1, "ctx": 128, "hbm_bound_cell": False, "cuda_us": 4.8, "triton_us": 5.8,
                     "cuda_speedup_vs_sdpa": 1.05, "triton_speedup_vs_sdpa": 0.86, "bound_speedup_vs_sdpa": 2.0,
                     "bound_at_spec_speedup_vs_sdpa": 2.0},
                    {"batch": 16, "ctx": 8192, "hbm_bound_cell": True, "cuda_us": 143.0, "triton_us": 145.0,
                     "cuda_speedup_vs_sdpa": 0.85, "triton_speedup_vs_sdpa": 0.84, "bound_speedup_vs_sdpa": 0.99,
                     "bound_at_spec_speedup_vs_sdpa": 1.09}]}
    p = tmp_path / "bench_ceiling.json"
    p.write_text(json.dumps(d))
    assert plot_results.main([str(p)]) == 0 and _png(tmp_path / "bench_ceiling.png")
    del d["decode"][1]["bound_speedup_vs_sdpa"]
    p.write_text(json.dumps(d))
    with pytest.raises(KeyError):
        plot_results.plot_ceiling(str(p))
