"""bench/roofline.py: the read floor of a rollout (weights once per decode step plus the active K/V) and each arm's
share of it, checked against a hand count at the 7B shape."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))

import roofline  # noqa: E402


def test_floor_of_the_7b_decode_step(monkeypatch):
    monkeypatch.setattr(roofline, "read_rate_bytes_per_s", lambda: 4.0e12)
    arms = {"fast": {"workloads": {"w": {"tokens_per_s": 9000.0}}}, "other": {"workloads": {}}}
    r = roofline.roofline("qwen2.5-7b", [((64, 100, 10), "w")], arms)
    # by hand: 28 layers of q/o 3584x3584, k/v 3584x512, gate/up/down 3584x18944, two norms; lm_head + final norm
    layer = 2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944 + 2 * 3584
    weights = 2 * (28 * layer + 152064 * 3584 + 3584)
    kv_token = 2 * 28 * 4 * 128 * 2
    read = 10 * weights + 64 * kv_token * (10 * 100 + 45)
    floor = 64 * 10 / (read / 4.0e12)
    row = r["workloads"]["w"]
    assert row["floor_tokens_per_s"] == pytest.approx(floor, rel=1e-6)
    assert row["fast"] == pytest.approx(9000.0 / floor, abs=1e-3) and "other" not in row
    assert r["weight_gb"] == round(weights / 1e9, 2) and r["read_rate_tb_s"] == 4.0
    # longer contexts only lower the floor
    longer = roofline.roofline("qwen2.5-7b", [((64, 2000, 10), "w")], {})["workloads"]["w"]["floor_tokens_per_s"]
    assert longer < row["floor_tokens_per_s"]
