"""The tik_preset load format hands a model's ``load_weights`` the preset's tensors under checkpoint names: for an
MoE preset, the experts per expert, exactly as transformers 5 writes the same model to disk (what a stock vLLM
MoE model maps into its fused experts), and the same bits."""
from __future__ import annotations

import glob
import os

import torch
from safetensors.torch import load_file

from areal_tik.layers.models import build_model
from areal_tik.vllm_plugin.preset_loader import checkpoint_items


def test_preset_tensors_carry_the_names_and_bits_of_the_saved_checkpoint(tmp_path):
    model = build_model("tiny-qwen3-moe", dtype=torch.bfloat16, device="cpu", seed=2)
    model.save_pretrained(str(tmp_path))
    saved = {}
    for f in glob.glob(os.path.join(str(tmp_path), "*.safetensors")):
        saved.update(load_file(f))
    items = dict(checkpoint_items(model.state_dict()))
    if model.config.tie_word_embeddings:
        items.pop("lm_head.weight", None)
    assert sorted(items) == sorted(saved)
    assert any(".experts.5.down_proj.weight" in n for n in items)
    for name, t in saved.items():
        assert torch.equal(items[name], t), name


def test_a_dense_preset_passes_through_unchanged():
    sd = build_model("tiny-qwen3", dtype=torch.bfloat16, device="cpu", seed=0).state_dict()
    items = checkpoint_items(sd)
    assert [n for n, _ in items] == list(sd) and all(t is sd[n] for n, t in items)
