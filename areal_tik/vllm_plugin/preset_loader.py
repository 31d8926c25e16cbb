"""A vLLM load format that fills any model (stock or tik) with one of our presets' seeded random weights.

``vllm.LLM(model=config_only_dir, load_format="tik_preset",
model_loader_extra_config={"preset": "qwen2.5-7b", "seed": 0})`` builds the preset exactly as
:func:`areal_tik.layers.models.build_model` does (same seed, same device, same weights as our engine and
trainer build) and hands its state dict to the model's own ``load_weights`` (HF names; vLLM stacks q/k/v and
gate/up itself). No checkpoint is written or read, so speed and parity runs at 7B and larger shapes need only
a folder with ``config.json`` (:func:`config_dir`), and every arm (stock vLLM, vLLM + tik, our engine, the
trainer) holds the same weights.
"""
from __future__ import annotations

import gc
import os

import torch

from areal_tik.layers.models import build_model, preset_config

LOAD_FORMAT = "tik_preset"


def config_dir(preset: str, path: str) -> str:
    """A folder holding only the preset's ``config.json`` (what vLLM reads with ``load_format=tik_preset``)."""
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(path, exist_ok=True)
        cfg = preset_config(preset)
        cfg.torch_dtype = "bfloat16"
        cfg.save_pretrained(path)
    return path


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
                model.load_weights(iter(src.state_dict().items()))
            del src
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    _REGISTERED.append(TikPresetLoader)
