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


def test_floor_of_an_moe_step_counts_the_experts_a_batch_reaches(monkeypatch):
    """Qwen3-30B-A3B shape: each decode step reads attention, router and norms of 48 layers, the lm_head, and the
    experts its batch routes to: k of 128 for one token, 128 * (1 - (1 - 8/128) ** B) expected for B tokens."""
    from areal_tik.layers.models import preset_config
    cfg = preset_config("qwen3-30b-a3b")
    H, E, k, I = 2048, 128, 8, 768
    attn = H * 32 * 128 * 2 + 2 * H * 4 * 128 + 2 * H
    fixed = 2 * (48 * (attn + E * H) + 151936 * H + H)
    expert = 2 * 48 * 3 * H * I
    assert roofline.step_weight_bytes(cfg, 1) == pytest.approx(fixed + k * expert, rel=1e-9)
    assert roofline.step_weight_bytes(cfg, 64) == pytest.approx(fixed + E * (1 - (1 - k / E) ** 64) * expert, rel=1e-9)
    assert roofline.step_weight_bytes(cfg, 1 << 30) == pytest.approx(fixed + E * expert, rel=1e-9)
    monkeypatch.setattr(roofline, "read_rate_bytes_per_s", lambda: 4.0e12)
    r = roofline.roofline("qwen3-30b-a3b", [((1, 10, 4), "one"), ((64, 10, 4), "b64")], {})
    assert r["weight_gb"] == round((fixed + E * expert) / 1e9, 2)          # ~61 GB: every expert
    gain = r["workloads"]["b64"]["floor_tokens_per_s"] / r["workloads"]["one"]["floor_tokens_per_s"]
    assert 1 < gain < 64      # 64 sequences share the attention and lm_head reads, but reach ~16x the experts
