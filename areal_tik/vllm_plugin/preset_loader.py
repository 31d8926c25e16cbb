"""A vLLM load format that fills any model (stock or tik) with one of our presets' seeded random weights.

``vllm.LLM(model=config_only_dir, load_format="tik_preset",
model_loader_extra_config={"preset": "qwen2.5-7b", "seed": 0})`` builds the preset exactly as
:func:`areal_tik.layers.models.build_model` does (same seed, same device, same weights as our engine and
trainer build) and hands its state dict to the model's own ``load_weights`` under checkpoint names (HF names,
MoE experts per expert: :func:`checkpoint_items`; vLLM stacks q/k/v, gate/up and the experts itself). No checkpoint is written or read, so speed and parity runs at 7B and larger shapes need only
a folder with ``config.json`` (:func:`config_dir`), and every arm (stock vLLM, vLLM + tik, our engine, the
trainer) holds the same weights.
"""
from __future__ import annotations

import gc
import os

import torch

from areal_tik.layers.models import build_model, preset_config
from areal_tik.layers.moe import per_expert_views

LOAD_FORMAT = "tik_preset"


def config_dir(preset: str, path: str) -> str:
    """A folder holding only the preset's ``config.json`` (what vLLM reads with ``load_format=tik_preset``), naming
    the family's HF causal-LM class as its architecture, as a checkpoint's config does (without it vLLM resolves
    some families to their base model and runs them as a pooling model)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(path, exist_ok=True)
        cfg = preset_config(preset)
        cfg.torch_dtype = "bfloat16"
        cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type]]
        cfg.save_pretrained(path)
    return path


def checkpoint_items(state_dict: dict) -> list[tuple[str, torch.Tensor]]:
    """``state_dict``'s tensors as a checkpoint on disk names them: fused MoE expert weights (how transformers 5
    holds them) as per-expert tensors (how checkpoints store them, and what a stock vLLM MoE model's
    ``load_weights`` maps); every other tensor as it is."""
    views = per_expert_views(state_dict)
    fused = {name for name, _ in views.values()}
    return [(n, t) for n, t in state_dict.items() if n not in fused] + [(n, v) for n, (_, v) in views.items()]


def llm_kwargs(preset: str, seed: int = 0) -> dict:
    """``vllm.LLM`` keyword arguments that load ``preset``'s weights (with a :func:`config_dir` model folder)."""
    return dict(load_format=LOAD_FORMAT, model_loader_extra_config={"preset": preset, "seed": int(seed)})


_REGISTERED = []


def register() -> None:
    """Register the load format with vLLM (once per process; called from the plugin's entry point)."""
    if _REGISTERED:
        return
    # optional dependency (vllm): imported only on this path
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    @register_model_loader(LOAD_FORMAT)
    class TikPresetLoader(BaseModelLoader):
        """Weights of a named preset built on the load device (seeded), fed through ``model.load_weights``."""

        def __init__(self, load_config):
            super().__init__(load_config)
            extra = dict(load_config.model_loader_extra_config or {})
            if "preset" not in extra:
                raise ValueError(f"load_format={LOAD_FORMAT!r} needs model_loader_extra_config={{'preset': name}}")
            self.preset, self.seed = str(extra["preset"]), int(extra.get("seed", 0))

        def download_model(self, model_config) -> None:
            pass

        def load_weights(self, model, model_config) -> None:
            device = next(model.parameters()).device
            src = build_model(self.preset, dtype=model_config.dtype, device=device, seed=self.seed)
            with torch.no_grad():
                model.load_weights(iter(checkpoint_items(src.state_dict())))
            del src
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    _REGISTERED.append(TikPresetLoader)
