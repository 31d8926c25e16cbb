"""bench/probes/probe_attention_pair.py's whole-run arithmetic (the GPU cells need FA3 and the csrc extension)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench", "probes"))

import probe_attention_pair as p  # noqa: E402


def test_whole_run_integrates_decode_over_the_generated_contexts():
    # 1 ms per layer-call at every context: 4,096 steps x 28 layers = 114.688 s; the forward cell x 28 layers
    dec = {(64, c): 1.0 for c in (1024, 2048, 3072, 4096, 5120)}
    dec[(1, 4096)] = 99.0                     # other batches do not enter
    w = p.whole_run(dec, {(64, 5120): 10.0})
    assert w["decode_s"] == pytest.approx(4096 * 28 / 1e3)
    assert w["forward_s"] == pytest.approx(0.28)
    # linear in the context: the trapezoid is exact
    lin = {(64, c): c / 1024 for c in (1024, 3072, 5120)}
    assert p.whole_run(lin, {})["decode_s"] == pytest.approx((1 + 5) / 2 * 4096 * 28 / 1e3)


def test_whole_run_needs_both_ends_of_the_context_range():
    w = p.whole_run({(64, 1024): 1.0, (64, 3072): 1.0}, {})
    assert w["decode_s"] is None and w["forward_s"] is None
    assert p.whole_run({(64, 1024): 1.0, (64, 5120): None}, {})["decode_s"] is None   # a failed cell


def test_cells_cover_the_whole_run():
    B, lo, hi = p.LONG_ROLLOUT["batch"], p.LONG_ROLLOUT["prompt"], p.LONG_ROLLOUT["prompt"] + p.LONG_ROLLOUT["new"]
    assert (B, lo) in p.DECODE_CELLS and (B, hi) in p.DECODE_CELLS and (B, hi) in p.FORWARD_CELLS
