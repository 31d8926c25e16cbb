"""Embedded rollout engine on a patched HF model (paged KV cache, continuous batching,
batch-invariant sampling, CUDA graphs). Public names are imported lazily."""
from __future__ import annotations

import importlib

__all__ = ["LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput"]

_WHERE = {
    "LLMEngine": "areal_tik.engine.llm_engine",
    "EngineConfig": "areal_tik.engine.config",
    "SamplingParams": "areal_tik.engine.sequence",
    "RequestOutput": "areal_tik.engine.sequence",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'areal_tik.engine' has no attribute {name!r}")
