"""A digest of a weight snapshot's *compute* bits, equal on trainer and rollout server.

docs/design.md section 6, condition 4: the trainer skips the old-policy forward only if its
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
from contextlib import nullcontext as _nullcontext
from typing import Iterable

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24
_P1, _P2 = 65521, 65519


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency; a bare torch install still digests
    triton = None

if triton is not None:
    @triton.jit
    def _weighted_bit_sums_kernel(bits_ptr, out_ptr, n, P1: tl.constexpr, P2: tl.constexpr, BLOCK: tl.constexpr):
        """Per program, over BLOCK elements of the raw bits (an int view): sum(v * (i % P1 + 1)) and
        sum(v * ((7i + 3) % P2 + 1)) in int64 (i = global element index) -> out[2 * pid + {0, 1}]."""
        pid = tl.program_id(0).to(tl.int64)
        idx = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        v = tl.load(bits_ptr + idx, mask=idx < n, other=0).to(tl.int64)
        tl.store(out_ptr + 2 * pid, tl.sum(v * (idx % P1 + 1), axis=0))
        tl.store(out_ptr + 2 * pid + 1, tl.sum(v * ((idx * 7 + 3) % P2 + 1), axis=0))


_TRITON_BLOCK = 4096
COMPILE_SPECS = [] if triton is None else [
    {"fn": _weighted_bit_sums_kernel, "signature": {"bits_ptr": f"*{b}", "out_ptr": "*i64", "n": "i32"},
     "constexprs": {"P1": _P1, "P2": _P2, "BLOCK": _TRITON_BLOCK}} for b in ("u8", "i16")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits, flat (floats viewed as the same-width integers)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(_INT_VIEW[flat.element_size()]) if flat.is_floating_point() else flat


def _triton_sums(t: torch.Tensor) -> list[torch.Tensor]:
    """The two sums of :func:`_chunk_sums` over the whole tensor in one pass (one kernel, then an
    exact int64 sum of the per-program partials). Equal to the chunked reference: each term is
    below 2^15 * 2^16 in magnitude, so any tensor under 2^31 elements sums below 2^62 (no
    wrap-around), and integer addition does not depend on order. Hence 1- and 2-byte elements
    only: 4-byte bit patterns (~2^31) wrap int64, and the reference adds its wrapped per-chunk
    sums as Python ints. The trainer's per-step digest of a 1.5B model reads its bf16 bits once."""
    flat = _bits(t)
    n = flat.numel()
    if n == 0:
        z = torch.zeros((), dtype=torch.int64, device=flat.device)
        return [z, z.clone()]
    grid = (triton.cdiv(n, _TRITON_BLOCK),)
    partial = torch.empty((grid[0], 2), dtype=torch.int64, device=flat.device)
    with torch.cuda.device(flat.device) if flat.is_cuda else _nullcontext():  # Triton launches on the current device
        _weighted_bit_sums_kernel[grid](flat, partial, n, P1=_P1, P2=_P2, BLOCK=_TRITON_BLOCK)
    tot = partial.sum(0)
    return [tot[0], tot[1]]


def _use_triton(t: torch.Tensor) -> bool:
    return (triton is not None and t.is_cuda and t.element_size() <= 2 and t.numel() < (1 << 31))


def _chunk_sums(t: torch.Tensor) -> list[torch.Tensor]:
    """Per chunk of ``t``'s raw bits, the two weighted int64 sums as 0-dim tensors on ``t``'s
    device (no host sync here: the caller reads all of them back at once). The reference,
    and the path off CUDA; on CUDA :func:`_triton_sums` gives the same totals in one pass."""
    flat = _bits(t)
    out = []
    for start in range(0, flat.numel(), _CHUNK):
        v = flat[start:start + _CHUNK].to(torch.int64)
        idx = torch.arange(start, start + v.numel(), device=v.device, dtype=torch.int64)
        out.append((v * (idx % _P1 + 1)).sum())
        out.append((v * ((idx * 7 + 3) % _P2 + 1)).sum())
    return out


def digest(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = torch.bfloat16) -> str:
    """Hex digest (16 chars) of the tensors cast to ``dtype`` (``None``: as they are), by name.

    The per-chunk sums stay on the device until one read-back per device (a 1.5B model has
    338 tensors: one sync instead of ~700); they are added as Python ints, exactly."""
    items = []
    for name, t in sorted(named_tensors, key=lambda kv: kv[0]):
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        items.append((name, tuple(t.shape), t.dtype, _triton_sums(t) if _use_triton(t) else _chunk_sums(t)))
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for *_, sums in items:
        for x in sums:
            by_device.setdefault(x.device, []).append(x)
    host = {d: iter(torch.stack(xs).tolist()) for d, xs in by_device.items()}
    h = hashlib.sha256()
    for name, shape, dt, sums in items:
        vals = [next(host[x.device]) for x in sums]
        s1, s2 = sum(vals[0::2]), sum(vals[1::2])
        h.update(f"{name}|{shape}|{dt}|{s1}|{s2};".encode())
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
            yield canonical_name(n), t
    return digest(list(items()), dtype)


def canonical_name(name: str) -> str:
    """A parameter's HF name: FSDP / torch.compile / activation-checkpoint wrappers insert these into names."""
    for junk in ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(junk, "")
    return name
