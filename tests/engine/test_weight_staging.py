"""Weight updates from an MoE checkpoint: transformers 5 keeps a Qwen3-MoE model's experts fused
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) but saves checkpoints under per-expert names
(``mlp.experts.<e>.{gate,up,down}_proj.weight``): what AReaL's disk weight update hands the rollout server."""
from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors import safe_open

from areal_tik.engine import weight_staging
from areal_tik.layers import moe
from areal_tik.layers.models import build_model


def _saved_names(path: str) -> set[str]:
    names = set()
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(f, "pt") as h:
            names.update(h.keys())
    return names


def test_an_update_from_a_per_expert_checkpoint_loads_every_expert_bit_for_bit(tmp_path):
    live = build_model("tiny-qwen3-moe", dtype=torch.bfloat16, device="cpu", seed=0)
    new = build_model("tiny-qwen3-moe", dtype=torch.bfloat16, device="cpu", seed=1)
    new.save_pretrained(str(tmp_path))
    names = _saved_names(str(tmp_path))
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names and \
        not any(n.endswith("experts.gate_up_proj") for n in names), sorted(names)[:12]
    weight_staging.commit(weight_staging.stage(live, str(tmp_path)))
    want = dict(new.named_parameters())
    for name, p in live.named_parameters():
        assert torch.equal(p, want[name]), name
    # gate and up are the two halves of gate_up_proj in HF's order (gate rows first)
    g = new.model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(live.model.layers[1].mlp.experts.gate_up_proj[3, : g.shape[1] // 2], g[3, : g.shape[1] // 2])


def test_without_the_per_expert_views_the_same_update_is_refused(tmp_path, monkeypatch):
    """Negative control: the staging table without the views does not know the checkpoint's names."""
    live = build_model("tiny-qwen3-moe", dtype=torch.bfloat16, device="cpu", seed=0)
    build_model("tiny-qwen3-moe", dtype=torch.bfloat16, device="cpu", seed=1).save_pretrained(str(tmp_path))
    before = [p.clone() for p in live.parameters()]
    monkeypatch.setattr(moe, "per_expert_views", lambda named: {})
    with pytest.raises(weight_staging.UnknownParameterError, match=r"experts\.\d+\."):
        weight_staging.stage(live, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(before, live.parameters()))


def test_per_expert_views_alias_the_fused_weights():
    t = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    d = torch.arange(2 * 3 * 3, dtype=torch.float32).reshape(2, 3, 3)
    v = moe.per_expert_views({"m.experts.gate_up_proj": t, "m.experts.down_proj": d, "m.other.weight": t[0]})
    assert sorted(v) == sorted(f"m.experts.{e}.{p}_proj.weight" for e in (0, 1) for p in ("gate", "up", "down"))
    fused, up1 = v["m.experts.1.up_proj.weight"]
    assert fused == "m.experts.gate_up_proj" and torch.equal(up1, t[1, 3:])
    up1.fill_(-1.0)   # a view: writing it writes the fused tensor
    assert (t[1, 3:] == -1).all() and (t[1, :3] >= 0).all() and torch.equal(v["m.experts.0.down_proj.weight"][1], d[0])


def test_an_update_under_the_models_own_names_never_builds_the_expert_views(monkeypatch):
    """A distributed update sends the fused names: staging it must not build every expert's view (18k views per
    bucket at the 48-layer 30B-A3B shape)."""
    live = build_model("tiny-qwen3-moe", dtype=torch.bfloat16, device="cpu", seed=0)
    new = build_model("tiny-qwen3-moe", dtype=torch.bfloat16, device="cpu", seed=1)

    def refuse(named):
        raise AssertionError("per-expert views built for own names")
    monkeypatch.setattr(moe, "per_expert_views", refuse)
    weight_staging.commit(weight_staging.stage(live, dict(new.state_dict())))
    assert all(torch.equal(a, b) for a, b in zip(live.parameters(), new.parameters()))
