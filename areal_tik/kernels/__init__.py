"""Kernels: pure math, one module per op.

Each op module holds its Triton kernel(s), launcher, autograd Function, a contract-keeping
pure-PyTorch implementation (``torch_ref``) and a float64 reference for accuracy, and declares
``OPS`` / ``META`` / ``COMPILE_SPECS`` tables that ``areal_tik.dispatch`` discovers.
``attention/``, ``linear/`` and ``logprobs/`` are op packages of small files; ``cuda/`` loads
the csrc extension and wraps its kernels; ``exported/`` holds the optimisation agent's exports.
Nothing here imports from a higher layer.
"""
from __future__ import annotations

import importlib
import os
import pkgutil

__all__ = ["op_modules", "module_sources", "interpreting"]


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"

# Subpackages whose own __init__ is not an op module, or that are discovered another way.
_NOT_OPS = {"exported"}


def op_modules() -> list[str]:
    """Dotted names of the modules that may declare ``OPS`` / ``COMPILE_SPECS``, in a fixed
    order: every public module of ``areal_tik.kernels``, op packages (``attention``, ``linear``,
    ``logprobs``: their ``__init__`` declares the tables) as one module, the modules of other
    subpackages (``cuda``), exports excluded."""
    names: list[str] = []

    def walk(pkg_name: str, path) -> None:
        for m in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
            if m.name.startswith("_") or m.name in _NOT_OPS:
                continue
            full = f"{pkg_name}.{m.name}"
            if not m.ispkg:
                names.append(full)
                continue
            pkg = importlib.import_module(full)
            if hasattr(pkg, "OPS") or hasattr(pkg, "COMPILE_SPECS"):
                names.append(full)        # an op package (attention): its files are one op module
            else:
                walk(full, pkg.__path__)  # a folder of op modules (cuda)

    walk(__name__, __path__)
    return names


def module_sources(mod) -> list[str]:
    """The files whose text defines an op module's numerics: the module's file, or every
    ``.py`` / ``.json`` file of an op package (hashed into the kernel fingerprint)."""
    path = getattr(mod, "__path__", None)
    if not path:
        return [mod.__file__]
    root = list(path)[0]
    return sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith((".py", ".json")))
