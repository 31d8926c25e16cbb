"""CUDA C++ backend (``csrc/tik_elementwise.cu``) of the KV-cache write, RMSNorm and RoPE: the
wrappers (validation, autograd) over the extension of :mod:`.extension` (which holds the build
constants, ``META``, ``CUDA_SOURCES`` and the stale-build checks).

Entry points (``OPS``), same signatures as the Triton backend (docs/interfaces.md):
``kv_cache_write(k, v, k_cache, v_cache, slot_mapping)``; ``rms_norm(x, weight, eps)``;
``apply_rope(x, cos, sin, positions)``; ``rope_table`` (the one table of every backend).

RMSNorm: HF rounding points, one warp per row, reduction order fixed by N only (row
invariant). RoPE: fp32 products and sum rounded separately, one rounding to x's dtype.
kv_cache_write: byte copies (exact).

Backward: ``rms_norm``: the Triton RMSNorm backward kernel on each row's rstd from the Triton
forward; ``apply_rope``: the csrc RoPE kernel's transpose.
"""
from __future__ import annotations

import torch

from areal_tik.kernels.cuda.extension import (  # CUDA_SOURCES, META: the registry reads them here
    CUDA_SOURCES, META, need_cuda, extension,
)

__all__ = ["kv_cache_write_cuda", "rms_norm_cuda", "rms_norm_backward", "apply_rope_cuda", "OPS", "META",
           "CUDA_SOURCES"]


def kv_cache_write_cuda(k, v, k_cache, v_cache, slot_mapping):
    """Copy ``k[t], v[t]`` into cache slot ``slot_mapping[t]`` (negative slots skipped). In place."""
    name = "kv_cache_write"
    need_cuda(name, ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping))
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"{name}: k/v must be [Tk, Hkv, D] of one shape, got {tuple(k.shape)} / {tuple(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"{name}: caches must be [num_pages, page_size, {k.shape[1]}, {k.shape[2]}], got "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype) or k.element_size() not in (2, 4):
        raise TypeError(f"{name}: dtypes must match and be 2 or 4 bytes: {k.dtype} {v.dtype} {k_cache.dtype} "
                        f"{v_cache.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != (k.shape[0],):
        raise TypeError(f"{name}: slot_mapping must be int32/int64 [{k.shape[0]}], got {slot_mapping.dtype} "
                        f"{tuple(slot_mapping.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{name}: caches must be contiguous")
    extension().kv_cache_write(k.contiguous(), v.contiguous(), k_cache, v_cache,
                               slot_mapping.to(torch.int64).contiguous())


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def rms_norm_backward(x, w, eps, dy):
    """(dx, dw) of HF RMSNorm, the backward of the csrc rms_norm and of an agent-exported one
    (areal_tik.agent.export): the Triton backward kernel of ``kernels/rms_norm.py`` (fp32 maths, dw from
    fixed per-program partial sums) on each row's ``rsqrt(mean(x^2) + eps)`` from its Triton forward. Like
    the attention's backward, a gradient: accurate, not part of the bitwise contract."""
    from areal_tik.kernels.rms_norm import rms_norm_bwd, rms_norm_fwd  # lazy: keeps triton out of this module's import
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    _, rstd = rms_norm_fwd(x2, w, eps, store_rstd=True)  # the Triton forward's rstd (its y is not used)
    dx, dw = rms_norm_bwd(dy.reshape(-1, n), x2, w, rstd)
    return dx.view(x.shape), dw


class _RMSNormCudaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return extension().rms_norm_fwd(x, w, eps)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return (*rms_norm_backward(x, w, ctx.eps, dy), None)


def rms_norm_cuda(x, weight, eps, out=None):
    """HF-semantics RMSNorm ``w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)`` (CUDA, one
    warp per row; a row's bits depend only on that row and N). x ``[..., N]`` bf16/fp16/fp32
    with a unit last stride, weight ``[N]`` of x's dtype. Backward: :func:`rms_norm_backward`."""
    name = "rms_norm"
    need_cuda(name, ("x", x), ("weight", weight))
    if x.dtype not in _FLOATS or weight.dtype != x.dtype:
        raise TypeError(f"{name}: x ({x.dtype}) and weight ({weight.dtype}) must share a dtype in {_FLOATS}")
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"{name}: x {tuple(x.shape)} and weight {tuple(weight.shape)} need x[..., N], weight[N]")
    w = weight.contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormCudaFunction.apply(x, w, float(eps))
    return extension().rms_norm_fwd(x, w, float(eps), out=out)


# ---------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------

class _RopeCudaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, positions):
        ctx.save_for_backward(cos, sin, positions)
        return extension().apply_rope_fwd(x, cos, sin, positions)

    @staticmethod
    def backward(ctx, dy):
        cos, sin, positions = ctx.saved_tensors
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        return extension().apply_rope_fwd(dy, cos, sin, positions, backward=True), None, None, None


def apply_rope_cuda(x, cos, sin, positions, out=None):
    """Neox (rotate-half) RoPE: ``out[:h] = x1*cos1 - x2*sin1``, ``out[h:] = x2*cos2 + x1*sin2`` in
    fp32 (each product and sum rounded, no FMA), rounded once to x's dtype. x ``[T, H, D]``
    (unit last stride, other strides free), cos/sin fp32 ``[P, D]``, positions int32/int64
    ``[T]`` in ``[0, P)`` (clamped on the GPU, never read out of bounds). New contiguous output.
    Backward: the same kernel's transpose (csrc ``tik_apply_rope(..., backward=1)``)."""
    name = "apply_rope"
    need_cuda(name, ("x", x), ("cos", cos), ("sin", sin), ("positions", positions))
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name}: x dtype {x.dtype} unsupported; {_FLOATS}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"{name}: cos/sin must be float32")
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: positions must be int32/int64, got {positions.dtype}")
    if x.dim() != 3:
        raise ValueError(f"{name}: x must be [T, H, D], got {tuple(x.shape)}")
    T, H, D = x.shape
    if D % 2 or cos.dim() != 2 or cos.shape[1] != D or sin.shape != cos.shape:
        raise ValueError(f"{name}: cos/sin must be [P, {D}] (even D), got {tuple(cos.shape)}/{tuple(sin.shape)}")
    if positions.shape != (T,):
        raise ValueError(f"{name}: positions must be [{T}], got {tuple(positions.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    pos = positions.to(torch.int64).contiguous()
    c, s = cos.contiguous(), sin.contiguous()
    if torch.is_grad_enabled() and x.requires_grad:
        return _RopeCudaFunction.apply(x, c, s, pos)
    return extension().apply_rope_fwd(x, c, s, pos, out=out)


OPS = {
    "kv_cache_write": {"cuda": kv_cache_write_cuda},
    "rms_norm": {"cuda": rms_norm_cuda},
    "apply_rope": {"cuda": apply_rope_cuda},
}


def _rope_table(*args, **kwargs):
    """The one RoPE table (built on the CPU in float64, see ``kernels/rope.py``); listed here so
    a ``backend="cuda"`` request finds it. Identical for every backend."""
    from areal_tik.kernels.rope import rope_table  # lazy: keeps triton out of this module's import
    return rope_table(*args, **kwargs)


OPS["rope_table"] = {"cuda": _rope_table}
