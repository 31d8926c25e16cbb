"""The ``vllm.general_plugins`` entry point: ``register()`` runs in every vLLM process.

It registers the tik model classes (lazily, by ``module:Class`` strings, so no CUDA or model
import happens here), the tik attention backend in vLLM's CUSTOM slot and the ``tik_preset`` load
format (:mod:`.preset_loader`). Registration alone changes nothing for other models: vLLM uses them
only for the ``Tik*`` architectures (``vllm_plugin.llm_kwargs``), ``attention_backend="CUSTOM"`` or
``load_format="tik_preset"``. Safe to call many times.
"""
from __future__ import annotations

from areal_tik.vllm_plugin import ARCHITECTURES, preset_loader

__all__ = ["register"]

_MODEL_MODULE = "areal_tik.vllm_plugin.model"
_BACKEND_PATH = "areal_tik.vllm_plugin.attention.TikAttentionBackend"


def register() -> None:
    # optional dependency (vllm): imported only on this path
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for arch in ARCHITECTURES.values():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"{_MODEL_MODULE}:{arch}")
    register_backend(AttentionBackendEnum.CUSTOM, _BACKEND_PATH)
    preset_loader.register()
