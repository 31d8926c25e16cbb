"""Model construction for tests, benchmarks and ``areal-tik verify``.

``build_model(name_or_dir)`` returns an HF causal LM (``AutoModelForCausalLM``):
either a named preset built from an HF config with seeded random weights (no download,
ever), or a local HF checkpoint directory. The model is *not* patched; call
``areal_tik.patch_model(model, kernels=...)`` next.

Presets:
- ``tiny-qwen2``, ``tiny-qwen3``, ``tiny-llama``: 2 layers, hidden 128, head_dim 64,
  GQA 2/1, vocab 512 -- small enough for fast CPU tests through the torch_ref kernels.
- ``qwen2.5-1.5b``, ``qwen2.5-7b``: the released shapes (random weights).
"""
from __future__ import annotations

import os

import torch

__all__ = ["PRESETS", "preset_config", "build_model"]

_TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
             rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

PRESETS: dict[str, dict] = {
    "tiny-qwen2": dict(model_type="qwen2", **_TINY, rope_theta=10000.0),
    "tiny-qwen3": dict(model_type="qwen3", **{**_TINY, "num_attention_heads": 4}, rope_theta=10000.0),
    "tiny-llama": dict(model_type="llama", **_TINY, rope_theta=500000.0),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645),
}


def preset_config(name: str, **overrides):
    """The HF config object of preset ``name`` (``overrides`` replace fields)."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; presets: {sorted(PRESETS)}")
    kw = {**PRESETS[name], **overrides}
    model_type = kw.pop("model_type")
    theta = kw.pop("rope_theta")
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": theta})
    if model_type == "qwen2":
        kw.setdefault("use_sliding_window", False)
    if model_type in ("qwen2", "llama") and kw.get("head_dim") == kw["hidden_size"] // kw["num_attention_heads"]:
        kw.pop("head_dim")  # implied by hidden_size / heads
    cfg = AutoConfig.for_model(model_type, **kw)
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
    from transformers import AutoModelForCausalLM

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
