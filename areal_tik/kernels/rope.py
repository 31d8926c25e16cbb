"""Rotary position embedding (neox / rotate-half style, as HF Qwen2/Llama).

Table: :func:`rope_table` builds ``cos, sin`` fp32 ``[max_positions, D]`` with
``cos[p, i] = cos[p, i + D/2] = cos(p' * inv_freq[i])`` (``p'`` = p, or p/factor for
linear scaling), ``inv_freq[i] = 1 / theta^(2i/D)`` (llama3 scaling supported). It is
computed one way everywhere: on the CPU, in float64, with ``inv_freq`` from Python's
``math`` and sin/cos from a Cody-Waite range reduction plus Taylor polynomials built only
from exactly-rounded float64 ops, then rounded once to fp32 and moved to ``device``. So
the table's bits depend on (D, max_positions, theta, scaling) only — not on the device,
the batch, or torch's vectorised ``cos``. Return plain tensors (not parameters/buffers,
so FSDP never casts them). Accuracy: each entry is the correctly rounded fp32 of the
float64 value up to ~1e-15 relative error before rounding. Angles must stay below 1.6e6
rad (positions up to ~1.6M at inv_freq 1).

apply: :func:`apply_rope` maps x ``[T, H, D]`` (bf16/fp16/fp32, strides free except a
unit last stride; e.g. a view into a fused qkv output) with positions ``[T]`` (int32 or
int64, each in ``[0, max_positions)``, not range-checked on the GPU) to a new contiguous
``[T, H, D]`` of x's dtype: ``out[:D/2] = x1*cos1 - x2*sin1``,
``out[D/2:] = x2*cos2 + x1*sin2`` in fp32, rounded once to x's dtype (Triton: the partner's product
rounded, then one explicit fma, :func:`rotated`; csrc and torch: each product and the sum rounded).
Accuracy vs :func:`apply_rope_reference` (float64 from the same table): rel err < 1e-2 bf16.

Invariance: purely elementwise per (token, head); a token's result depends only on its
own row and position (any T, packing or order). The Triton kernel may contract the
products into FMAs; the torch_ref path uses separate ops — each backend is consistent
with itself.

Backward: the transposed rotation (``dx1 = dy1*cos1 + dy2*sin2``,
``dx2 = dy2*cos2 - dy1*sin1``), same kernel; no gradient for the table.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from areal_tik.kernels._dense_common import (
    check_contiguous, check_dtype, check_last_dim_contiguous, check_same_device, check_triton_device, div16_attrs,
)

__all__ = ["MAX_ANGLE", "rope_table", "apply_rope_triton", "apply_rope_torch", "apply_rope_reference", "rope_launch",
           "validate_rope"]

# pi/2 split into 33-bit pieces (fdlibm): n * PIO2_1 and n * PIO2_2 are exact for |n| < 2**20
_PIO2_1 = 1.57079632673412561417e+00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624871116645580e-21
_TWO_OVER_PI = 6.36619772367581382433e-01
MAX_ANGLE = 1.6e6   # largest angle (rad) the exact range reduction of _sincos64 handles


def _sincos64(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic float64 (sin, cos) from exactly-rounded ops (no vectorised libm)."""
    n = torch.round(a * _TWO_OVER_PI)
    r = ((a - n * _PIO2_1) - n * _PIO2_2) - n * _PIO2_3  # |r| <= pi/4 (+tiny)
    r2 = r * r
    # sin r = r * (1 - r^2/3! + r^4/5! - ...), cos r = 1 - r^2/2! + ... ; degree 21/22 (< 1e-19 error)
    s = torch.full_like(r, 0.0)
    for k in range(21, 0, -2):
        s = s * r2
        s = s + ((-1.0) ** ((k - 1) // 2)) / math.factorial(k)
    s = s * r
    c = torch.full_like(r, 0.0)
    for k in range(22, -1, -2):
        c = c * r2
        c = c + ((-1.0) ** (k // 2)) / math.factorial(k)
    q = torch.remainder(n, 4.0)
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> list[float]:
    inv = [1.0 / (float(theta) ** ((2 * i) / head_dim)) for i in range(head_dim // 2)]
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", "linear"):
        return inv
    if kind == "llama3":
        factor = float(scaling["factor"])
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        lo_wl, hi_wl = old / lo, old / hi
        out = []
        for f in inv:
            wl = 2 * math.pi / f
            if wl < hi_wl:
                out.append(f)
            elif wl > lo_wl:
                out.append(f / factor)
            else:
                sm = (old / wl - lo) / (hi - lo)
                out.append((1 - sm) * f / factor + sm * f)
        return out
    raise ValueError(f"rope_table: unsupported rope scaling {scaling!r} (supported: None, linear, llama3)")


def rope_table(head_dim: int, max_positions: int, theta: float = 10000.0, device=None,
               scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` fp32 ``[max_positions, head_dim]``, identical bits everywhere."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope_table: head_dim must be positive and even, got {head_dim}")
    if max_positions <= 0:
        raise ValueError(f"rope_table: max_positions must be positive, got {max_positions}")
    inv = torch.tensor(_inv_freq(head_dim, theta, scaling), dtype=torch.float64)
    pos = torch.arange(max_positions, dtype=torch.float64)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        pos = pos / float(scaling["factor"])
    ang = pos[:, None] * inv[None, :]
    if float(ang.abs().max()) >= MAX_ANGLE:
        raise ValueError(f"rope_table: angles up to {float(ang.abs().max()):.3g} rad exceed the exact range reduction "
                         f"limit {MAX_ANGLE:g}")
    s, c = _sincos64(ang)
    cos = torch.cat([c, c], 1).to(torch.float32)
    sin = torch.cat([s, s], 1).to(torch.float32)
    if device is not None:
        cos, sin = cos.to(device), sin.to(device)
    return cos.contiguous(), sin.contiguous()


@triton.jit
def rotated(x, partner, c, s, sign):
    """One RoPE output ``x*c + sign*partner*s`` (fp32; ``sign`` +-1, a scalar or per column): the partner's
    product rounded, negated exactly (a product with -1 keeps signed zeros), then one explicit fma. Written out
    so the compiler has no contraction to choose: every kernel that rotates (this one, ``qk_norm_rope``) gets
    the same bits from the same values."""
    return tl.fma(x, c, (partner * s) * sign)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, y_ptr, H, stride_xt, stride_xh, stride_yt, stride_yh,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    hmask = offs_h[:, None] < H
    p = tl.load(pos_ptr + t).to(tl.int64)
    c1 = tl.load(cos_ptr + p * (2 * HALF) + offs_d)[None, :]
    c2 = tl.load(cos_ptr + p * (2 * HALF) + HALF + offs_d)[None, :]
    s1 = tl.load(sin_ptr + p * (2 * HALF) + offs_d)[None, :]
    s2 = tl.load(sin_ptr + p * (2 * HALF) + HALF + offs_d)[None, :]
    xb = x_ptr + t * stride_xt + offs_h[:, None].to(tl.int64) * stride_xh + offs_d[None, :]
    x1 = tl.load(xb, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF, mask=hmask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = rotated(x1, x2, c1, s2, 1.0)
        o2 = rotated(x2, x1, c2, s1, -1.0)
    else:
        o1 = rotated(x1, x2, c1, s1, -1.0)
        o2 = rotated(x2, x1, c2, s2, 1.0)
    yb = y_ptr + t * stride_yt + offs_h[:, None].to(tl.int64) * stride_yh + offs_d[None, :]
    tl.store(yb, o1.to(y_ptr.dtype.element_ty), mask=hmask)
    tl.store(yb + HALF, o2.to(y_ptr.dtype.element_ty), mask=hmask)


def rope_launch(x, cos, sin, positions, backward, out=None):
    """The Triton kernel on ``x [T, H, D]`` (forward, or with ``backward`` its transpose) into ``out`` or a new
    contiguous tensor; no checks."""
    T, H, D = x.shape
    y = out if out is not None else torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return y
    bh = min(triton.next_power_of_2(H), max(1, 4096 // D))
    _rope_kernel[(T, triton.cdiv(H, bh))](x, cos, sin, positions, y, H, x.stride(0), x.stride(1), y.stride(0),
                                          y.stride(1), HALF=D // 2, BLOCK_H=bh, BACKWARD=backward, num_warps=4)
    return y


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, positions):
        ctx.save_for_backward(cos, sin, positions)
        return rope_launch(x, cos, sin, positions, False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin, positions = ctx.saved_tensors
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        return rope_launch(dy, cos, sin, positions, True), None, None, None


def validate_rope(x, cos, sin, positions, triton_path):
    """The op's argument checks (one-line ``ValueError`` / ``TypeError``)."""
    check_dtype("x", x)
    check_dtype("cos", cos, (torch.float32,))
    check_dtype("sin", sin, (torch.float32,))
    check_dtype("positions", positions, (torch.int32, torch.int64))
    if x.dim() != 3:
        raise ValueError(f"apply_rope: x must be [T, H, D], got shape {tuple(x.shape)}")
    T, H, D = x.shape
    if D % 2 or cos.dim() != 2 or cos.shape[1] != D or sin.shape != cos.shape:
        raise ValueError(f"apply_rope: cos/sin must be [P, {D}] (even D), got {tuple(cos.shape)}/{tuple(sin.shape)}")
    if D // 2 & (D // 2 - 1):
        raise ValueError(f"apply_rope: D/2 must be a power of two for the Triton kernel, got D={D}")
    if positions.shape != (T,):
        raise ValueError(f"apply_rope: positions must be [T]=[{T}], got {tuple(positions.shape)}")
    check_contiguous("cos", cos)
    check_contiguous("sin", sin)
    check_contiguous("positions", positions)
    check_last_dim_contiguous("x", x)
    named = (("x", x), ("cos", cos), ("sin", sin), ("positions", positions))
    (check_triton_device if triton_path else check_same_device)(*named)
    if positions.device.type == "cpu" and T and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
        raise ValueError(f"apply_rope: positions outside [0, {cos.shape[0]})")


def apply_rope_triton(x, cos, sin, positions):
    """Rotate-half RoPE, fp32 math, one rounding (see module docstring)."""
    validate_rope(x, cos, sin, positions, True)
    if torch.is_grad_enabled() and x.requires_grad:
        return _RopeFn.apply(x, cos, sin, positions)
    return rope_launch(x, cos, sin, positions, False)


def apply_rope_torch(x, cos, sin, positions):
    """Same maths with separate exactly-rounded torch ops (autograd through plain ops)."""
    validate_rope(x, cos, sin, positions, False)
    D = x.shape[-1]
    h = D // 2
    c = cos.index_select(0, positions.long())[:, None, :]
    s = sin.index_select(0, positions.long())[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., :h], xf[..., h:]
    o1 = x1 * c[..., :h] - x2 * s[..., :h]
    o2 = x2 * c[..., h:] + x1 * s[..., h:]
    return torch.cat([o1, o2], -1).to(x.dtype)


def apply_rope_reference(x, cos, sin, positions):
    """float64 rotation with the given table."""
    h = x.shape[-1] // 2
    c = cos.double()[positions.long()][:, None, :]
    s = sin.double()[positions.long()][:, None, :]
    xd = x.double()
    rot = torch.cat([-xd[..., h:], xd[..., :h]], -1)
    return xd * c + rot * s


OPS = {"apply_rope": {"triton": apply_rope_triton, "torch_ref": apply_rope_torch},
       "rope_table": {"triton": rope_table, "torch_ref": rope_table}}
META = {"rope.table": "cpu float64 cody-waite+taylor, rounded to fp32", "rope.style": "neox rotate-half"}

_SIG = {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "y_ptr": "*bf16", "H": "i32",
        "stride_xt": "i32", "stride_xh": "i32", "stride_yt": "i32", "stride_yh": "i32"}
COMPILE_SPECS = [
    dict(fn=_rope_kernel, signature=_SIG, constexprs={"HALF": 64, "BLOCK_H": 32, "BACKWARD": b}, num_warps=4,
         attrs=div16_attrs(_rope_kernel, ["x_ptr", "cos_ptr", "sin_ptr", "y_ptr", "stride_xt", "stride_xh"]))
    for b in (False, True)
] + [dict(fn=_rope_kernel, signature=dict(_SIG, pos_ptr="*i32"), constexprs={"HALF": 32, "BLOCK_H": 16,
                                                                              "BACKWARD": False}, num_warps=4)]
