"""Kernel fingerprint: identifies the numerics of one backend on one stack.

The contract (docs/design.md section 2) holds within one backend, on one GPU architecture
and software stack. The fingerprint hashes exactly what can change the bits: the source
text and meta-parameters of the implementation selected for every op, the torch,
triton and CUDA versions, and the GPU architecture. The trainer reuses rollout
log-probs only when the rollout engine reports the same fingerprint.
"""
from __future__ import annotations

import hashlib
import json
import platform

from areal_tik.dispatch import registry


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def environment() -> dict:
    import torch
    try:
        import triton
        triton_v = triton.__version__
    except Exception:  # pragma: no cover
        triton_v = None
    gpu = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        gpu = {"name": p.name, "arch": f"sm_{p.major}{p.minor}", "sms": p.multi_processor_count}
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_v,
        "cuda": torch.version.cuda,
        "gpu": gpu,
    }


def selection(backend: str | None = None) -> dict[str, str]:
    """op -> backend name that :func:`registry.select_impl` picks now."""
    out = {}
    for op in sorted(registry.implementations()):
        try:
            out[op] = registry.select_impl(op, backend).backend
        except registry.BackendUnavailable as e:
            out[op] = f"unavailable: {e}"
    return out


def compute(backend: str | None = None, env: dict | None = None) -> dict:
    """``{"fingerprint": hex16, "selection": {...}, "environment": {...}}``."""
    env = env or environment()
    h = hashlib.sha256()
    sel = selection(backend)
    impls = registry.implementations()
    for op, be in sel.items():
        h.update(f"op={op};backend={be};".encode())
        info = impls[op].get(be)
        if info is None:
            continue
        for src in info.sources:
            h.update(hashlib.sha256(_read(src)).digest())
        h.update(json.dumps(list(info.meta), sort_keys=True, default=str).encode())
    stack = {k: env.get(k) for k in ("torch", "triton", "cuda")}
    stack["arch"] = (env.get("gpu") or {}).get("arch", "cpu")
    h.update(json.dumps(stack, sort_keys=True).encode())
    return {"fingerprint": h.hexdigest()[:16], "selection": sel, "environment": env}
