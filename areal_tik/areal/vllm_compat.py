"""Aliases that let AReaL 1.0.4's vLLM server import on vLLM 0.24.

``areal.engine.vllm_ext.areal_vllm_server`` imports ``validate_json_request`` from
``vllm.entrypoints.openai.utils`` and ``cli_env_setup``, ``load_aware_call``,
``with_cancellation`` from ``vllm.entrypoints.utils``. vLLM 0.24 keeps all four in
``vllm.entrypoints.serve.utils.api_utils`` and has neither old module. :func:`install_aliases`
fills exactly those names in: a missing old module becomes an alias module holding them; an old
module that exists but lacks a name gets that attribute; a name already there is left alone, so
a vLLM that still has the old layout is untouched. Nothing else of AReaL's server changes.
"""
from __future__ import annotations

import importlib
import sys
import types

__all__ = ["NEW_HOME", "MOVED", "install_aliases"]

NEW_HOME = "vllm.entrypoints.serve.utils.api_utils"
MOVED = {"vllm.entrypoints.openai.utils": ("validate_json_request",),
         "vllm.entrypoints.utils": ("cli_env_setup", "load_aware_call", "with_cancellation")}


def _existing(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and name != e.name and not name.startswith(e.name + "."):
            raise   # the module exists but one of its own imports is missing: not ours to paper over
        return None


def install_aliases() -> list[str]:
    """Install the aliases that are missing; return what was added (``module:name``, or ``module``
    for a whole alias module). Raises ``ImportError`` naming the name when neither the old module
    nor :data:`NEW_HOME` has it."""
    added: list[str] = []
    home = None
    for old, names in MOVED.items():
        mod = _existing(old)
        missing = [n for n in names if mod is None or not hasattr(mod, n)]
        if not missing:
            continue
        if home is None:
            home = importlib.import_module(NEW_HOME)
        absent = [n for n in missing if not hasattr(home, n)]
        if absent:
            raise ImportError(f"vLLM has {', '.join(absent)} neither in {old} nor in {NEW_HOME}: "
                              f"AReaL's vLLM server cannot run on this vLLM")
        if mod is None:
            mod = types.ModuleType(old, f"alias of {NEW_HOME} for AReaL's vLLM server (areal_tik.areal.vllm_compat)")
            sys.modules[old] = mod
            parent, _, leaf = old.rpartition(".")
            setattr(importlib.import_module(parent), leaf, mod)
            added.append(old)
        for n in missing:
            setattr(mod, n, getattr(home, n))
            added.append(f"{old}:{n}")
    return added
