"""areal-tik: one set of kernels for AReaL's rollout and training, so rollout log-probs
equal training log-probs bit for bit and the old-policy recompute pass can be skipped.

Public names (imported lazily: ``import areal_tik`` loads neither torch nor the kernels):
``patch_model``, ``Settings``, ``build_model``, ``Report``.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

__all__ = ["patch_model", "Settings", "build_model", "Report", "__version__"]

_WHERE = {
    "patch_model": "areal_tik.layers.patch",
    "Settings": "areal_tik.settings",
    "build_model": "areal_tik.layers.models",
    "Report": "areal_tik.verify.contract",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'areal_tik' has no attribute {name!r}")
