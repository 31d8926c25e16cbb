"""A digest of a weight snapshot's *compute* bits, equal on trainer and rollout server.

DESIGN.md section 3, condition 4: the trainer skips the old-policy forward only if its
weights are bitwise the snapshot the rollout used. Both sides call :func:`digest` on
``(name, tensor)`` pairs after casting to the compute dtype (bf16 usually): the trainer
on its FSDP parameters (gathered full tensors), the server on the model it loaded.

Per tensor, two position-weighted integer sums of the raw bit patterns are taken with
int64 arithmetic (exact, so independent of device, thread count and reduction order;
no overflow below ~2^31 elements per chunk), then sha256 over names, shapes, dtypes and
sums. It is a checksum, not a cryptographic hash of the bytes, but any single changed
element changes it, and so does any swap of two differing elements.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24
_P1, _P2 = 65521, 65519


def _sums(t: torch.Tensor) -> tuple[int, int]:
    flat = t.detach().contiguous().reshape(-1)
    if flat.is_floating_point():
        flat = flat.view(_INT_VIEW[flat.element_size()])
    s1 = s2 = 0
    for start in range(0, flat.numel(), _CHUNK):
        v = flat[start:start + _CHUNK].to(torch.int64)
        idx = torch.arange(start, start + v.numel(), device=v.device, dtype=torch.int64)
        w1 = idx % _P1 + 1
        w2 = (idx * 7 + 3) % _P2 + 1
        s1 += int((v * w1).sum())
        s2 += int((v * w2).sum())
    return s1, s2


def digest(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = torch.bfloat16) -> str:
    """Hex digest (16 chars) of the tensors cast to ``dtype`` (``None``: as they are), by name."""
    h = hashlib.sha256()
    for name, t in sorted(named_tensors, key=lambda kv: kv[0]):
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        s1, s2 = _sums(t)
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|{s1}|{s2};".encode())
    return h.hexdigest()[:16]


def model_digest(model: torch.nn.Module, dtype: torch.dtype | None = torch.bfloat16) -> str:
    """:func:`digest` over ``model.named_parameters()`` (tied weights counted once).

    DTensor (FSDP2) parameters are gathered with ``full_tensor()``; every rank must call it.
    """
    def items():
        for n, p in model.named_parameters():
            t = p.data
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            yield _canonical_name(n), t
    return digest(list(items()), dtype)


def _canonical_name(name: str) -> str:
    # FSDP / torch.compile / activation-checkpoint wrappers insert these into names.
    for junk in ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(junk, "")
    return name
