"""SiLU-and-multiply (the SwiGLU MLP's activation) with HF's rounding points.

Maths: ``y = round( round(silu(gate)) * up )`` — ``silu(g) = g * sigmoid(g)`` computed in
fp32 (triton) or float64 (torch_ref) and rounded to the input dtype (as
``ACT2FN["silu"](gate_proj(x))`` in a bf16 HF model), then the product computed in fp32
and rounded (as ``bf16 * bf16`` in PyTorch).

Shapes/dtypes: gate, up of one shape and dtype (bf16, fp16, fp32), contiguous; output
contiguous, same shape/dtype. Accuracy vs :func:`silu_mul_reference` (float64): rel err
< 1e-2 bf16, < 1e-5 fp32.

Invariance: elementwise; an element's bits depend only on (gate, up) at that element —
any batch, order, packing. (Triton uses its fp32 exp; torch_ref uses the deterministic
``_torch_math.silu``; each backend is consistent with itself.)

``silu_mul_packed(gu)``: the same element maths on a packed ``[..., 2I]`` input whose first half is
``gate`` and second half ``up`` (the output of one GEMM over the stacked gate/up weights): bit for
bit ``silu_mul(gu[..., :I], gu[..., I:])``, output ``[..., I]`` contiguous. Forward only (the
rollout side: inference engines that stack the two projections).

Backward (HF autograd's rounding points): ``ds = round(dy * up)``,
``dgate = round(ds * sig * (1 + g * (1 - sig)))``, ``dup = round(dy * round(silu(g)))``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from areal_tik.kernels import _torch_math as tm
from areal_tik.kernels._dense_common import (
    check_contiguous, check_dtype, check_last_dim_contiguous, check_same_device, check_same_dtype, check_triton_device,
    div16_attrs,
)

__all__ = ["silu_mul_triton", "silu_mul_torch", "silu_mul_reference", "silu_mul_packed_triton",
           "silu_mul_packed_torch", "silu_times"]

BLOCK = 2048


@triton.jit
def silu_times(g, u, y_ptr):
    """``round(round(silu(g)) * u)`` to ``y_ptr``'s dtype from fp32 ``g``, ``u`` (values of that dtype): the element
    maths of every SiLU-and-multiply kernel, written once (this module's kernels and the fused gate/up GEMM's
    epilogue, ``kernels/linear_silu_mul``), so each gets the same bits from the same values."""
    s = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    return (s * u).to(y_ptr.dtype.element_ty)


@triton.jit
def _silu_mul_fwd_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, silu_times(g, u, y_ptr), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    s = (g * sig).to(dg_ptr.dtype.element_ty).to(tl.float32)
    ds = (dy * u).to(dg_ptr.dtype.element_ty).to(tl.float32)
    dg = ds * (sig * (1.0 + g * (1.0 - sig)))
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dy * s).to(du_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_packed_kernel(gu_ptr, y_ptr, I, stride_t, BLOCK: tl.constexpr):
    # one row per program along axis 0, BLOCK columns per program along axis 1; the element maths of
    # _silu_mul_fwd_kernel (silu_times)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    row = gu_ptr + t * stride_t
    g = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + I + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * I + cols, silu_times(g, u, y_ptr), mask=mask)


PACKED_BLOCK = 1024


def _validate_packed(gu, triton_path):
    check_dtype("gu", gu)
    if gu.dim() < 1 or gu.shape[-1] % 2:
        raise ValueError(f"silu_mul_packed: the last dim must hold gate then up (even size), got {tuple(gu.shape)}")
    check_last_dim_contiguous("gu", gu)
    (check_triton_device if triton_path else check_same_device)(("gu", gu))


def silu_mul_packed_triton(gu: torch.Tensor) -> torch.Tensor:
    """``silu_mul(gu[..., :I], gu[..., I:])`` from one packed tensor (rows may be strided)."""
    _validate_packed(gu, True)
    I = gu.shape[-1] // 2
    g2 = gu.reshape(-1, 2 * I) if gu.dim() != 2 else gu
    T = g2.shape[0]
    y = torch.empty((T, I), dtype=gu.dtype, device=gu.device)
    if T and I:
        _silu_mul_packed_kernel[(T, triton.cdiv(I, PACKED_BLOCK))](g2, y, I, g2.stride(0), BLOCK=PACKED_BLOCK,
                                                                    num_warps=4)
    return y.reshape(*gu.shape[:-1], I)


def silu_mul_packed_torch(gu: torch.Tensor) -> torch.Tensor:
    """The torch_ref backend's ``silu_mul`` on the two halves."""
    _validate_packed(gu, False)
    I = gu.shape[-1] // 2
    with torch.no_grad():
        return silu_mul_torch(gu[..., :I].contiguous(), gu[..., I:].contiguous())


def silu_mul_fwd(gate, up, out=None):
    y = out if out is not None else torch.empty_like(gate)
    n = gate.numel()
    if n:
        _silu_mul_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK, num_warps=8)
    return y


class _SiluMulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return silu_mul_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _silu_mul_bwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, dy, dg, du, n, BLOCK=BLOCK, num_warps=8)
        return dg, du


def _validate(gate, up, triton_path):
    check_dtype("gate", gate)
    check_dtype("up", up)
    check_same_dtype(gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    check_contiguous("gate", gate)
    check_contiguous("up", up)
    (check_triton_device if triton_path else check_same_device)(("gate", gate), ("up", up))


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``round(round(silu(gate)) * up)`` elementwise in Triton."""
    _validate(gate, up, True)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMulFn.apply(gate, up)
    return silu_mul_fwd(gate, up)


class _SiluMulTorchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        s = tm.silu(gate)
        return (s.float() * up.float()).to(gate.dtype)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dt = gate.dtype
        g = gate.double()
        sig = tm.sigmoid(g)
        s = tm.silu(gate).double()
        ds = (dy.double() * up.double()).to(dt).double()
        dg = (ds * (sig * (1.0 + g * (1.0 - sig)))).to(dt)
        du = (dy.double() * s).to(dt)
        return dg, du


def silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Same rounding points from deterministic elementwise torch ops (any device)."""
    _validate(gate, up, False)
    return _SiluMulTorchFn.apply(gate, up)


def silu_mul_reference(gate, up):
    """float64 ``silu(gate) * up``."""
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()


OPS = {"silu_mul": {"triton": silu_mul_triton, "torch_ref": silu_mul_torch},
       "silu_mul_packed": {"triton": silu_mul_packed_triton, "torch_ref": silu_mul_packed_torch}}
META = {"silu_mul.rounding": "silu->dtype, product->dtype"}

COMPILE_SPECS = [
    dict(fn=_silu_mul_fwd_kernel, signature={"g_ptr": "*bf16", "u_ptr": "*bf16", "y_ptr": "*bf16", "n": "i32"},
         constexprs={"BLOCK": BLOCK}, num_warps=8,
         attrs=div16_attrs(_silu_mul_fwd_kernel, ["g_ptr", "u_ptr", "y_ptr", "n"])),
    dict(fn=_silu_mul_bwd_kernel, signature={"g_ptr": "*bf16", "u_ptr": "*bf16", "dy_ptr": "*bf16", "dg_ptr": "*bf16",
                                             "du_ptr": "*bf16", "n": "i32"},
         constexprs={"BLOCK": BLOCK}, num_warps=8,
         attrs=div16_attrs(_silu_mul_bwd_kernel, ["g_ptr", "u_ptr", "dy_ptr", "dg_ptr", "du_ptr", "n"])),
    dict(fn=_silu_mul_packed_kernel, signature={"gu_ptr": "*bf16", "y_ptr": "*bf16", "I": "i32", "stride_t": "i32"},
         constexprs={"BLOCK": PACKED_BLOCK}, num_warps=4,
         attrs=div16_attrs(_silu_mul_packed_kernel, ["gu_ptr", "y_ptr", "I", "stride_t"])),
]
