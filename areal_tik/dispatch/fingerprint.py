"""Kernel fingerprint: identifies the numerics of one backend on one stack.

The contract (docs/design.md section 2) holds within one backend, on one GPU architecture
and software stack. The fingerprint hashes exactly what can change the bits: the source
text and meta-parameters of the implementation bound for every op (a :class:`BoundOps`, the
object ``patch_model`` gives a model: the fingerprint never selects on its own), the torch,
triton and CUDA versions, and the GPU architecture. The trainer reuses rollout log-probs only
when the rollout engine reports the same fingerprint.
"""
from __future__ import annotations

import hashlib
import json
import platform

from areal_tik.dispatch.bound import BoundOps


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def environment() -> dict:
    import torch  # lazy: keeps torch out of this module's import
    try:
        import triton  # lazy: keeps triton out of this module's import
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


def compute(ops: BoundOps, env: dict | None = None) -> dict:
    """``{"fingerprint": hex16, "selection": {op: backend}, "environment": {...}}`` of the ops ``ops``
    binds (a model's ``ops_of(model)``, or ``bind(spec)`` where there is no model) on this stack."""
    env = env or environment()
    h = hashlib.sha256()
    for op, info in sorted(ops.impls.items()):
        h.update(f"op={op};backend={info.backend};".encode())
        for src in info.sources:
            h.update(hashlib.sha256(_read(src)).digest())
        h.update(json.dumps(list(info.meta), sort_keys=True, default=str).encode())
    stack = {k: env.get(k) for k in ("torch", "triton", "cuda")}
    stack["arch"] = (env.get("gpu") or {}).get("arch", "cpu")
    h.update(json.dumps(stack, sort_keys=True).encode())
    return {"fingerprint": h.hexdigest()[:16], "selection": ops.selection, "environment": env}
