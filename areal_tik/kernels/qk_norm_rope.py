"""Per-head q/k RMSNorm (optional) then RoPE, for q and k in one launch.

Maths, for every (token t, head h) row of q ``[T, Hq, D]`` and of k ``[T, Hk, D]``::

    y   = rms_norm(x_row, w, eps)          (with weights: ``kernels/rms_norm``'s rounding points)
    out = apply_rope(y, cos, sin, pos[t])  (``kernels/rope``: fp32 rotation, one rounding)

with ``w`` = ``q_weight`` for q rows and ``k_weight`` for k rows (both given, or both None: RoPE only).
Returns contiguous ``(q_out [T, Hq, D], k_out [T, Hk, D])`` of q's dtype. This is the decoder graph's
``q_norm``/``k_norm`` and RoPE (``layers/decoder.py``) as one op: a tik step runs it where it computes the
bound ``rms_norm``'s and ``apply_rope``'s arithmetic (``layers/modules.fuses_norm_rope``).

Shapes/dtypes: q, k bf16 / fp16 / fp32 with any token and head strides (a unit last stride: e.g. views into a
stacked q/k/v GEMM output, no copy), the same T; D even with D/2 a power of two; weights ``[D]`` of q's dtype,
contiguous; cos/sin fp32 ``[P, D]`` and positions ``[T]`` as :func:`~areal_tik.kernels.rope.apply_rope_triton`
takes them. Accuracy vs :func:`qk_norm_rope_reference` (float64): relative error below 1e-2 (bf16).

Triton: program (t, b) takes ``HEADS`` rows of token t (the q heads' blocks first, then k's). Each row is
normalised as a one-row tile of ``BLOCK_N = next_pow2(D)`` with the norm's warps (``rms_norm.norm_block``)
through the norm kernel's own row functions (``row_rstd``, ``row_scaled``), and rotated by the RoPE
kernel's own function (``rope.rotated``: the partner's product rounded, then one explicit fma, so no
contraction is left to the compiler), the partner half read at the rotated offsets. So the fused result
equals ``rms_norm_triton`` then ``apply_rope_triton`` bit for bit where the compiler emits the same reduction
tree for the same row (``tests/kernels/test_qk_norm_rope.py`` checks it on the GPU and in the interpreter); a
host that fuses runs the fused op on both sides of the contract either way.
torch_ref: exactly ``rms_norm_torch`` then ``apply_rope_torch`` (the composition, the same bits).

Invariance: a row's result depends only on that row, its weight, eps and its token's position: one row per
reduction, a tile and warps fixed by D, never by T, the head count or the row's neighbours.

Backward (both backends): RoPE's transpose (``rope_launch(..., backward=True)``), then the RMSNorm backward
(``rms_norm_bwd``: dx and the weight's gradient) per q and k; accurate, not promised invariant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from areal_tik.kernels._dense_common import check_same_dtype, div16_attrs
from areal_tik.kernels.rms_norm import (
    norm_block, rms_norm_bwd, rms_norm_reference, rms_norm_torch, row_rstd, row_scaled, validate_rms_norm,
)
from areal_tik.kernels.rope import apply_rope_reference, apply_rope_torch, rope_launch, rotated, validate_rope

__all__ = ["qk_norm_rope_triton", "qk_norm_rope_torch", "qk_norm_rope_reference", "qk_norm_rope_launch",
           "HEADS_PER_PROGRAM"]

#: rows (heads of one token) per Triton program: a launch-shape knob, never bits (each row is its own tile)
HEADS_PER_PROGRAM = 4


@triton.jit
def _norm_rope_rows(x_ptr, stride_t, stride_h, w_ptr, o_ptr, rstd_ptr, t, h0, H, c, s, cols, partner, mask, N,
                    eps, HALF, HEADS: tl.constexpr, NORM: tl.constexpr, STORE_RSTD: tl.constexpr):
    """Rows ``h0 .. h0+HEADS`` (those below H) of token t: norm (``NORM``) then RoPE, stored to ``o_ptr``."""
    sign = tl.where(cols < HALF, -1.0, 1.0)      # the first half subtracts its partner's product
    for i in tl.static_range(HEADS):
        h = h0 + i
        if h < H:
            base = x_ptr + t * stride_t + h.to(tl.int64) * stride_h
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            xp = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
            if NORM:
                rstd = row_rstd(x, N, eps)
                a = row_scaled(x, tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32), rstd, o_ptr)
                b = row_scaled(xp, tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32), rstd, o_ptr)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
                if STORE_RSTD:
                    tl.store(rstd_ptr + t * H + h, rstd)
            else:
                a = x
                b = xp
            out = rotated(a, b, c, s, sign)
            tl.store(o_ptr + (t * H + h) * N + cols, out.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, ko_ptr, rq_ptr, rk_ptr,
                         HQ, HK, N, stride_qt, stride_qh, stride_kt, stride_kh, eps,
                         BLOCK_N: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr, STORE_RSTD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    nqb = (HQ + HEADS - 1) // HEADS
    half = N // 2
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    partner = tl.where(cols < half, cols + half, cols - half)
    p = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + p * N + cols, mask=mask, other=0.0)
    s = tl.load(sin_ptr + p * N + cols, mask=mask, other=0.0)
    if b < nqb:
        _norm_rope_rows(q_ptr, stride_qt, stride_qh, wq_ptr, qo_ptr, rq_ptr, t, b * HEADS, HQ, c, s, cols, partner,
                        mask, N, eps, half, HEADS, NORM, STORE_RSTD)
    else:
        _norm_rope_rows(k_ptr, stride_kt, stride_kh, wk_ptr, ko_ptr, rk_ptr, t, (b - nqb) * HEADS, HK, c, s, cols,
                        partner, mask, N, eps, half, HEADS, NORM, STORE_RSTD)


def qk_norm_rope_launch(q, k, q_weight, k_weight, eps, cos, sin, positions, store_rstd=False, out=None):
    """The Triton kernel, no checks: ``(q_out, k_out, q rstd, k rstd)`` (the rstd ``[T*H]`` fp32 when
    ``store_rstd``, for the backward), into ``out = (q_out, k_out)`` (contiguous) or new tensors."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    qo, ko = out if out is not None else (torch.empty((T, HQ, D), dtype=q.dtype, device=q.device),
                                          torch.empty((T, HK, D), dtype=q.dtype, device=q.device))
    norm = q_weight is not None
    rq = torch.empty(T * HQ, dtype=torch.float32, device=q.device) if store_rstd else None
    rk = torch.empty(T * HK, dtype=torch.float32, device=q.device) if store_rstd else None
    if T == 0:
        return qo, ko, rq, rk
    bn, nw = norm_block(D)
    hp = HEADS_PER_PROGRAM
    grid = (T, triton.cdiv(HQ, hp) + triton.cdiv(HK, hp))
    _qk_norm_rope_kernel[grid](q, k, q_weight if norm else q, k_weight if norm else k, cos, sin, positions, qo, ko,
                               rq if store_rstd else cos, rk if store_rstd else cos, HQ, HK, D, q.stride(0),
                               q.stride(1), k.stride(0), k.stride(1), float(eps), BLOCK_N=bn, HEADS=hp,
                               NORM=norm, STORE_RSTD=bool(store_rstd), num_warps=nw)
    return qo, ko, rq, rk


def _norm_backward(d_normed, x, w, rstd):
    """RMSNorm backward of rows ``x [T, H, D]`` (any strides) from ``d_normed``: ``(dx, dw)``."""
    D = x.shape[-1]
    dx, dw = rms_norm_bwd(d_normed.reshape(-1, D), x.reshape(-1, D), w, rstd)
    return dx.view(x.shape), dw


class _QKNormRopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps, cos, sin, positions):
        norm = q_weight is not None
        qo, ko, rq, rk = qk_norm_rope_launch(q, k, q_weight, k_weight, eps, cos, sin, positions, store_rstd=norm)
        ctx.save_for_backward(q, k, q_weight, k_weight, rq, rk, cos, sin, positions)
        return qo, ko

    @staticmethod
    def backward(ctx, dqo, dko):
        q, k, wq, wk, rq, rk, cos, sin, positions = ctx.saved_tensors
        grads = []
        for dy, x, w, r in ((dqo, q, wq, rq), (dko, k, wk, rk)):
            if dy is None:
                grads.append((None, None))
                continue
            d = rope_launch(dy if dy.stride(-1) == 1 else dy.contiguous(), cos, sin, positions, True)
            grads.append(_norm_backward(d, x, w, r) if w is not None else (d, None))
        (dq, dwq), (dk, dwk) = grads
        return dq, dk, dwq, dwk, None, None, None, None


def _validate(q, k, cos, sin, positions, q_weight, k_weight, triton_path):
    validate_rope(q, cos, sin, positions, triton_path)
    validate_rope(k, cos, sin, positions, triton_path)
    check_same_dtype(q=q, k=k)
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: give both q_weight and k_weight, or neither (RoPE only)")
    if q_weight is not None:
        validate_rms_norm(q, q_weight, triton_path)
        validate_rms_norm(k, k_weight, triton_path)


def qk_norm_rope_triton(q, k, cos, sin, positions, q_weight=None, k_weight=None, eps: float = 1e-6):
    """``(rope(rms_norm(q, q_weight)), rope(rms_norm(k, k_weight)))`` (norms only with weights) in one Triton
    launch (module docstring)."""
    _validate(q, k, cos, sin, positions, q_weight, k_weight, True)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, q_weight, k_weight)):
        return _QKNormRopeFn.apply(q, k, q_weight, k_weight, float(eps), cos, sin, positions)
    qo, ko, _, _ = qk_norm_rope_launch(q, k, q_weight, k_weight, eps, cos, sin, positions)
    return qo, ko


def qk_norm_rope_torch(q, k, cos, sin, positions, q_weight=None, k_weight=None, eps: float = 1e-6):
    """:func:`~areal_tik.kernels.rms_norm.rms_norm_torch` then :func:`~areal_tik.kernels.rope.apply_rope_torch`
    on q and on k (autograd through plain ops)."""
    _validate(q, k, cos, sin, positions, q_weight, k_weight, False)
    if q_weight is not None:
        q, k = rms_norm_torch(q, q_weight, eps), rms_norm_torch(k, k_weight, eps)
    return apply_rope_torch(q, cos, sin, positions), apply_rope_torch(k, cos, sin, positions)


def qk_norm_rope_reference(q, k, cos, sin, positions, q_weight=None, k_weight=None, eps: float = 1e-6):
    """float64 norm (with weights) then rotation, from the same table."""
    if q_weight is not None:
        q, k = rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)
    return apply_rope_reference(q, cos, sin, positions), apply_rope_reference(k, cos, sin, positions)


OPS = {"qk_norm_rope": {"triton": qk_norm_rope_triton, "torch_ref": qk_norm_rope_torch}}
META = {"qk_norm_rope.rows": "one row per reduction, rms_norm's BLOCK_N and warps"}
USES = ("areal_tik.kernels.rms_norm", "areal_tik.kernels.rope")

_SIG = {"q_ptr": "*bf16", "k_ptr": "*bf16", "wq_ptr": "*bf16", "wk_ptr": "*bf16", "cos_ptr": "*fp32",
        "sin_ptr": "*fp32", "pos_ptr": "*i64", "qo_ptr": "*bf16", "ko_ptr": "*bf16", "rq_ptr": "*fp32",
        "rk_ptr": "*fp32", "HQ": "i32", "HK": "i32", "N": "i32", "stride_qt": "i32", "stride_qh": "i32",
        "stride_kt": "i32", "stride_kh": "i32", "eps": "fp32"}
COMPILE_SPECS = [
    dict(fn=_qk_norm_rope_kernel, signature=_SIG,
         constexprs={"BLOCK_N": 128, "HEADS": HEADS_PER_PROGRAM, "NORM": norm, "STORE_RSTD": store},
         num_warps=norm_block(128)[1],
         attrs=div16_attrs(_qk_norm_rope_kernel, ["q_ptr", "k_ptr", "wq_ptr", "wk_ptr", "cos_ptr", "sin_ptr", "qo_ptr",
                                                  "ko_ptr", "N", "stride_qt", "stride_qh", "stride_kt", "stride_kh"]))
    for norm, store in ((True, False), (True, True), (False, False))
]
