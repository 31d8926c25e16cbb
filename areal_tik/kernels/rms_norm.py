"""Row-invariant RMSNorm with HF Qwen2/Llama rounding points.

Maths: ``y = w * round_to(x.dtype)( x.float() * rsqrt(mean(x.float()^2) + eps) )``, the
final product computed in fp32 and rounded to x's dtype (as ``bf16 * bf16`` in PyTorch).

Shapes/dtypes: x ``[..., N]`` (bf16, fp16 or fp32; rows may have any stride, the last dim
unit stride), weight ``[N]`` of x's dtype, contiguous; output contiguous like x. N <= 65536.

Accuracy: relative error against :func:`rms_norm_reference` (float64) below ``1e-2`` for
bf16 (two bf16 roundings, ~4e-3 typical), ``1e-5`` for fp32.

Invariance: each row is reduced by one program with a fixed block (``BLOCK_N =
next_pow2(N)``, warps from N only), so a row's bits do not depend on the number of rows,
their order or neighbours. torch_ref: the sum of squares is a fixed pairwise tree over
the row padded to a power of two (exactly-rounded adds), ``rsqrt = 1/sqrt`` (each
correctly rounded); same row invariance on any device, its own bits.

Backward: dx, dweight (fp32 partial sums per program, then summed) — accurate, not
promised invariant. The gradient treats the intermediate rounding as identity, like
autograd through HF's module.

``add_rms_norm(x, residual, weight, eps) -> (y, s)``: the decoder's residual add and the
next RMSNorm in one launch: ``s = round_to(x.dtype)(x.float() + residual.float())`` (the
bits of ``residual + x`` in PyTorch) and ``y = rms_norm(s)``, each row by the same
row function (``_norm_row``) as the RMSNorm kernel with the same block and warps, so ``(y, s)`` equal
``(rms_norm(residual + x), residual + x)`` bit for bit (triton: checked on the GPU by
``tests/kernels/test_rms_norm_add.py``; torch_ref: it is that composition). x and residual
of one dtype and shape ``[..., N]``, last dim unit stride. Backward: ``ds = dx_rms(dy) + ds``
flows to both inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from areal_tik.kernels._dense_common import (
    as_2d,
    check_contiguous, check_dtype, check_last_dim_contiguous, check_same_device, check_same_dtype,
    check_triton_device, div16_attrs,
)

__all__ = ["rms_norm_triton", "rms_norm_torch", "rms_norm_reference", "rms_norm_fwd", "rms_norm_bwd",
           "add_rms_norm_triton", "add_rms_norm_torch", "add_rms_norm_reference", "validate_rms_norm", "norm_block",
           "row_rstd", "row_scaled"]

MAX_N = 65536


@triton.jit
def row_rstd(x, N, eps):
    """``1 / sqrt(mean(x^2) + eps)`` of one row ``x`` (fp32, zero past N): the row's one reduction."""
    var = tl.sum(x * x, axis=0) / N
    return 1.0 / tl.sqrt_rn(var + eps)


@triton.jit
def row_scaled(x, w, rstd, y_ptr):
    """``w * round(x * rstd)`` rounded to ``y_ptr``'s dtype (x, w fp32): HF's two rounding points."""
    h = (x * rstd).to(y_ptr.dtype.element_ty)
    return (w * h.to(tl.float32)).to(y_ptr.dtype.element_ty)


@triton.jit
def _norm_row(x, w_ptr, y_ptr, rstd_ptr, row, cols, mask, N, stride_y, eps, STORE_RSTD: tl.constexpr):
    """One row ``x`` (fp32, zero past N) normalised at HF's rounding points; stores y (and rstd)."""
    rstd = row_rstd(x, N, eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = row_scaled(x, w, rstd, y_ptr)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, N, stride_x, stride_y, eps,
                         BLOCK_N: tl.constexpr, STORE_RSTD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _norm_row(x, w_ptr, y_ptr, rstd_ptr, row, cols, mask, N, stride_y, eps, STORE_RSTD)


@triton.jit
def _add_rms_norm_fwd_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, rstd_ptr, N, stride_x, stride_r, stride_y, stride_s,
                             eps, BLOCK_N: tl.constexpr, STORE_RSTD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    xa = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    ra = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    s = (xa + ra).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + row * stride_s + cols, s, mask=mask)
    _norm_row(s.to(tl.float32), w_ptr, y_ptr, rstd_ptr, row, cols, mask, N, stride_y, eps, STORE_RSTD)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_part_ptr, M, N,
                         stride_x, stride_dy, stride_dx, ROWS_PER_PROG: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(ROWS_PER_PROG):
        row = pid * ROWS_PER_PROG + i
        if row < M:
            r64 = row.to(tl.int64)
            x = tl.load(x_ptr + r64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + r64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            h = x * rstd
            dw += dy * h.to(dx_ptr.dtype.element_ty).to(tl.float32)
            dh = dy * w
            c = tl.sum(dh * h, axis=0) / N
            dx = rstd * (dh - h * c)
            tl.store(dx_ptr + r64 * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=mask)


def norm_block(N: int) -> tuple[int, int]:
    """``(BLOCK_N, num_warps)`` of a row of N: one row's reduction tree is fixed by these two (every kernel that
    normalises a row with :func:`row_rstd` launches with them)."""
    bn = triton.next_power_of_2(N)
    return bn, (4 if bn <= 1024 else 8 if bn <= 4096 else 16)


def rms_norm_fwd(x2, w, eps, out=None, store_rstd=False):
    """Launch the forward on ``x2 [M, N]``; returns ``(y, rstd or None)``."""
    M, N = x2.shape
    y = out if out is not None else torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x2.device) if store_rstd else None
    if M == 0:
        return y, rstd
    bn, nw = norm_block(N)
    _rms_norm_fwd_kernel[(M,)](x2, w, y, rstd if rstd is not None else y, N, x2.stride(0), y.stride(0), float(eps),
                               BLOCK_N=bn, STORE_RSTD=store_rstd, num_warps=nw)
    return y, rstd


def add_rms_norm_fwd(x2, r2, w, eps, store_rstd=False):
    """Launch the fused forward on ``x2, r2 [M, N]``; returns ``(y, s, rstd or None)``."""
    M, N = x2.shape
    y = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    s = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x2.device) if store_rstd else None
    if M == 0:
        return y, s, rstd
    bn, nw = norm_block(N)
    _add_rms_norm_fwd_kernel[(M,)](x2, r2, w, y, s, rstd if rstd is not None else y, N, x2.stride(0), r2.stride(0),
                                   y.stride(0), s.stride(0), float(eps), BLOCK_N=bn, STORE_RSTD=store_rstd,
                                   num_warps=nw)
    return y, s, rstd


def rms_norm_bwd(dy2, x2, w, rstd):
    M, N = x2.shape
    dy2 = dy2.contiguous()
    dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
    rows = 16 if M >= 4096 else 4
    progs = triton.cdiv(M, rows)
    part = torch.empty((max(progs, 1), N), dtype=torch.float32, device=x2.device)
    if M:
        bn, nw = norm_block(N)
        _rms_norm_bwd_kernel[(progs,)](x2, w, dy2, rstd, dx, part, M, N, x2.stride(0), dy2.stride(0),
                                       dx.stride(0), ROWS_PER_PROG=rows, BLOCK_N=bn, num_warps=nw)
    else:
        part.zero_()
    return dx, part.sum(0).to(w.dtype)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, eps):
        y, rstd = rms_norm_fwd(x2, w, eps, store_rstd=True)
        ctx.save_for_backward(x2, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dy, x2, w, rstd)
        return dx, dw, None


class _AddRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, r2, w, eps):
        y, s, rstd = add_rms_norm_fwd(x2, r2, w, eps, store_rstd=True)
        ctx.save_for_backward(s, w, rstd)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        s, w, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dy, s, w, rstd)
        if ds is not None:
            dx = dx + ds
        return dx, dx, dw, None


def validate_rms_norm(x, weight, triton_path):
    """The op's argument checks (one-line ``ValueError`` / ``TypeError``)."""
    check_dtype("x", x)
    check_dtype("weight", weight)
    check_same_dtype(x=x, weight=weight)
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} and weight {tuple(weight.shape)} need x[..., N], weight[N]")
    if x.shape[-1] > MAX_N:
        raise ValueError(f"rms_norm: N={x.shape[-1]} exceeds the one-block row limit {MAX_N}")
    check_contiguous("weight", weight)
    check_last_dim_contiguous("x", x)
    (check_triton_device if triton_path else check_same_device)(("x", x), ("weight", weight))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF-semantics RMSNorm, one row per Triton program (see module docstring)."""
    validate_rms_norm(x, weight, True)
    x2 = as_2d(x, "[M, N]")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        y = _RMSNormFn.apply(x2, weight, float(eps))
    else:
        y, _ = rms_norm_fwd(x2, weight, eps)
    return y.view(x.shape)


def _validate_add(x, residual, weight, triton_path):
    validate_rms_norm(x, weight, triton_path)
    check_same_dtype(x=x, residual=residual)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    check_last_dim_contiguous("residual", residual)
    (check_triton_device if triton_path else check_same_device)(("x", x), ("residual", residual))


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)`` in one Triton launch per row block (module docstring)."""
    _validate_add(x, residual, weight, True)
    x2, r2 = as_2d(x, "[M, N]"), as_2d(residual, "[M, N]")
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad):
        y, s = _AddRMSNormFn.apply(x2, r2, weight, float(eps))
    else:
        y, s, _ = add_rms_norm_fwd(x2, r2, weight, eps)
    return y.view(x.shape), s.view(x.shape)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add then :func:`rms_norm_torch` (plain PyTorch, autograd through plain ops)."""
    _validate_add(x, residual, weight, False)
    s = residual + x
    return rms_norm_torch(s, weight, eps), s


def add_rms_norm_reference(x, residual, weight, eps):
    """float64 ``(w * s / sqrt(mean(s^2) + eps), s)`` with ``s = x + residual``."""
    sd = x.double() + residual.double()
    return rms_norm_reference(sd, weight, eps), sd


def tree_sum_lastdim(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as a fixed pairwise tree (zero-padded to a power of two)."""
    n = v.shape[-1]
    p = 1 << max(0, (n - 1).bit_length())
    if p != n:
        v = torch.nn.functional.pad(v, (0, p - n))
    while p > 1:
        p //= 2
        v = v[..., :p] + v[..., p:]
    return v[..., 0]


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-invariant RMSNorm in plain PyTorch (autograd through plain ops)."""
    validate_rms_norm(x, weight, False)
    xf = x.float()
    var = tree_sum_lastdim(xf * xf) / x.shape[-1]
    rstd = 1.0 / torch.sqrt(var + eps)
    h = (xf * rstd[..., None]).to(x.dtype)
    return (weight.float() * h.float()).to(x.dtype)


def rms_norm_reference(x, weight, eps):
    """float64 ``w * x / sqrt(mean(x^2) + eps)``."""
    xd = x.double()
    return weight.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


OPS = {"rms_norm": {"triton": rms_norm_triton, "torch_ref": rms_norm_torch},
       "add_rms_norm": {"triton": add_rms_norm_triton, "torch_ref": add_rms_norm_torch}}
META = {"rms_norm.BLOCK_N": "next_pow2(N)", "rms_norm.num_warps": "4/8/16 by BLOCK_N",
        "rms_norm.torch_ref": "pairwise tree over pow2-padded row"}

_FWD_SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "rstd_ptr": "*fp32", "N": "i32",
            "stride_x": "i32", "stride_y": "i32", "eps": "fp32"}
_ADD_FWD_SIG = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "s_ptr": "*bf16",
                "rstd_ptr": "*fp32", "N": "i32", "stride_x": "i32", "stride_r": "i32", "stride_y": "i32",
                "stride_s": "i32", "eps": "fp32"}
_BWD_SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "dy_ptr": "*bf16", "rstd_ptr": "*fp32", "dx_ptr": "*bf16",
            "dw_part_ptr": "*fp32", "M": "i32", "N": "i32", "stride_x": "i32", "stride_dy": "i32",
            "stride_dx": "i32"}
COMPILE_SPECS = [
    dict(fn=_rms_norm_fwd_kernel, signature=_FWD_SIG, constexprs={"BLOCK_N": norm_block(n)[0], "STORE_RSTD": s},
         num_warps=norm_block(n)[1], attrs=div16_attrs(_rms_norm_fwd_kernel, ["x_ptr", "w_ptr", "y_ptr", "N"]))
    for n, s in ((1536, False), (3584, True))
] + [
    dict(fn=_add_rms_norm_fwd_kernel, signature=_ADD_FWD_SIG, constexprs={"BLOCK_N": norm_block(n)[0], "STORE_RSTD": s},
         num_warps=norm_block(n)[1])
    for n, s in ((1536, False), (3584, True))
] + [
    dict(fn=_rms_norm_bwd_kernel, signature=_BWD_SIG, constexprs={"ROWS_PER_PROG": 16, "BLOCK_N": norm_block(n)[0]},
         num_warps=norm_block(n)[1]) for n in (128, 3584)
]
