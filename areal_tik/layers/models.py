"""Model construction for tests, benchmarks and ``areal-tik verify``.

``build_model(name_or_dir)`` returns an HF causal LM (``AutoModelForCausalLM``):
either a named preset built from an HF config with seeded random weights (no download,
ever), or a local HF checkpoint directory. The model is *not* patched; call
``areal_tik.patch_model(model, kernels=...)`` next.

Presets (each family entry holds its own, ``layers/family.py``):
- ``tiny-qwen2``, ``tiny-qwen3``, ``tiny-llama``: 2 layers, hidden 128, head_dim 64,
  GQA 2/1, vocab 512 -- small enough for fast CPU tests through the torch_ref kernels.
- ``qwen2.5-1.5b``, ``qwen2.5-7b``: the released shapes (random weights).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from areal_tik.layers.family import FAMILIES, TableView

__all__ = ["PRESETS", "preset_config", "build_model", "checkpoint_dir"]


# preset name -> {"model_type": ..., **HF config fields}
PRESETS: Mapping[str, dict] = TableView(lambda: {name: {"model_type": f.model_type, **kw}
                                                  for f in FAMILIES.values() for name, kw in f.presets.items()})


def preset_config(name: str, **overrides):
    """The HF config object of preset ``name`` (``overrides`` replace fields)."""
    from transformers import AutoConfig   # lazy: seconds to import; argument checks read PRESETS without it

    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; presets: {sorted(PRESETS)}")
    kw = {**PRESETS[name], **overrides}
    family = FAMILIES[kw.pop("model_type")]
    theta = kw.pop("rope_theta")
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": theta})
    for field, value in family.config_defaults.items():
        kw.setdefault(field, value)
    if not family.head_dim_in_config and kw.get("head_dim") == kw["hidden_size"] // kw["num_attention_heads"]:
        kw.pop("head_dim")  # implied by hidden_size / heads
    cfg = AutoConfig.for_model(family.model_type, **kw)
    # Older/newer transformers spell RoPE theta differently; keep both in agreement.
    if getattr(cfg, "rope_parameters", None) is None:
        cfg.rope_theta = theta
    return cfg


def build_model(name_or_dir: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None,
                seed: int = 0, **overrides):
    """An HF causal LM from a preset name (seeded random init) or a local HF directory.

    ``device`` defaults to CUDA when available. Presets are initialised directly on the
    device (``torch.device`` context) with ``torch.manual_seed(seed)``; the same seed and
    device give the same weights.
    """
    from transformers import AutoModelForCausalLM   # lazy, as in preset_config

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if os.path.isdir(str(name_or_dir)):
        model = AutoModelForCausalLM.from_pretrained(str(name_or_dir), dtype=dtype)
        return model.to(device).eval()
    cfg = preset_config(name_or_dir, **overrides)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def checkpoint_dir(name_or_dir: str, path: str, device: str | torch.device | None = None, seed: int = 0,
                   dtype: torch.dtype = torch.bfloat16) -> str:
    """A local HF checkpoint of ``name_or_dir`` (what vLLM and AReaL load): the directory itself, or the preset
    built as :func:`build_model` builds it, saved to ``path`` (reused when ``path`` already holds one)."""
    if os.path.isdir(str(name_or_dir)):
        return str(name_or_dir)
    if not os.path.exists(os.path.join(path, "config.json")):
        model = build_model(name_or_dir, dtype=dtype, device=device, seed=seed)
        model.save_pretrained(path)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return path
