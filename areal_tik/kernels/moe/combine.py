"""Combining a token's expert outputs, and Qwen2-MoE's gated shared expert.

``moe_combine(expert_out [T, k, H], weights fp32 [T, k]) -> [T, H]`` in expert_out's dtype::

    acc = +0.0 (fp32);  for r = 0 .. k-1 (rank order):  acc = acc + weights[t, r] * float(expert_out[t, r])
    out[t] = round(acc)

each product and each sum rounded to fp32 separately (no fused multiply-add: the Triton kernel is compiled
with ``enable_fp_fusion=False``), rounded once to the output dtype. Both backends do exactly these fp32
operations, so their bits are equal. (HF rounds each weighted expert output to the model dtype and adds them
with ``index_add_`` in expert order; this is within that rounding of it.)

``moe_shared_add(routed [T, H], shared [T, H], gate_logit [T, 1]) -> [T, H]``, HF Qwen2-MoE's rounding points
in the model dtype: ``routed + round(round(sigmoid(gate_logit)) * shared)``.

Shapes/dtypes: bf16, fp16 or fp32 activations, contiguous. Accuracy vs :func:`combine_reference` (float64):
relative error below 1e-2 (bf16), 1e-5 (fp32).

Invariance: a token's output depends only on its own row of each input, in an order fixed by k alone: any
batch, any position. Backward (torch math, deterministic): ``d expert_out[t, r] = round(dout[t] * w[t, r])``,
``d w[t, r] = sum_h dout[t, h] * expert_out[t, r, h]`` in fp32; the shared add's gate gradient
``sum_h dout * shared * s (1 - s)``. Accurate, not promised invariant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from areal_tik.kernels import _torch_math as tm
from areal_tik.kernels.moe.checks import validate_combine, validate_shared_add

__all__ = ["combine_triton", "combine_torch", "combine_reference", "shared_add_triton", "shared_add_torch",
           "shared_add_reference", "BLOCK_H"]

BLOCK_H = 1024


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r in tl.static_range(K):                            # rank order
        w = tl.load(w_ptr + t * K + r)
        y = tl.load(y_ptr + (t * K + r) * H + cols, mask=mask, other=0.0).to(tl.float32)
        acc = acc + w * y
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _shared_add_kernel(r_ptr, s_ptr, g_ptr, out_ptr, H, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    dt = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + t).to(tl.float32)
    sg = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    sh = tl.load(s_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
    rt = tl.load(r_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
    prod = (sg * sh).to(dt).to(tl.float32)
    tl.store(out_ptr + t * H + cols, (rt + prod).to(dt), mask=mask)


def _combine_triton_fwd(y, w):
    T, K, H = y.shape
    out = torch.empty((T, H), dtype=y.dtype, device=y.device)
    if T and H:
        _combine_kernel[(T, triton.cdiv(H, BLOCK_H))](y, w, out, H, K=K, BLOCK_H=BLOCK_H, num_warps=4,
                                                       enable_fp_fusion=False)
    return out


def _combine_torch_fwd(y, w):
    T, K, H = y.shape
    acc = torch.zeros((T, H), dtype=torch.float32, device=y.device)
    yf = y.float()
    for r in range(K):                                      # rank order; separate mul and add
        acc = acc + w[:, r, None] * yf[:, r]
    return acc.to(y.dtype)


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fwd, y, w):
        ctx.save_for_backward(y, w)
        return fwd(y, w)

    @staticmethod
    def backward(ctx, dout):
        y, w = ctx.saved_tensors
        d = dout.float()[:, None, :]
        dy = (d * w[:, :, None]).to(y.dtype) if ctx.needs_input_grad[1] else None
        dw = (d * y.float()).sum(-1) if ctx.needs_input_grad[2] else None
        return None, dy, dw


def _combine(fwd, y, w, triton_path):
    validate_combine(y, w, triton_path)
    if torch.is_grad_enabled() and (y.requires_grad or w.requires_grad):
        return _CombineFn.apply(fwd, y, w)
    with torch.no_grad():
        return fwd(y, w)


def combine_triton(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``round(sum_r w[t, r] * y[t, r])``, fp32 in rank order, one Triton program per (token, column block)."""
    return _combine(_combine_triton_fwd, expert_out, weights, True)


def combine_torch(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The same fp32 operations in torch (any device): equal bits."""
    return _combine(_combine_torch_fwd, expert_out, weights, False)


def combine_reference(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float64 weighted sum."""
    return (expert_out.double() * weights.double()[:, :, None]).sum(1)


def _shared_add_triton_fwd(routed, shared, gate_logit):
    T, H = routed.shape
    out = torch.empty_like(routed)
    if T and H:
        _shared_add_kernel[(T, triton.cdiv(H, BLOCK_H))](routed, shared, gate_logit, out, H, BLOCK_H=BLOCK_H,
                                                          num_warps=4)
    return out


def _shared_add_torch_fwd(routed, shared, gate_logit):
    sg = tm.sigmoid(gate_logit).float()
    prod = (sg * shared.float()).to(routed.dtype)
    return (routed.float() + prod.float()).to(routed.dtype)


class _SharedAddFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fwd, routed, shared, gate_logit):
        ctx.save_for_backward(shared, gate_logit)
        return fwd(routed, shared, gate_logit)

    @staticmethod
    def backward(ctx, dout):
        shared, g = ctx.saved_tensors
        s = torch.sigmoid(g.float())
        d = dout.float()
        dshared = (d * s.to(g.dtype).float()).to(shared.dtype) if ctx.needs_input_grad[2] else None
        dg = ((d * shared.float()).sum(-1, keepdim=True) * s * (1.0 - s)).to(g.dtype) if ctx.needs_input_grad[3] \
            else None
        return None, dout, dshared, dg


def _shared_add(fwd, routed, shared, gate_logit, triton_path):
    validate_shared_add(routed, shared, gate_logit, triton_path)
    if torch.is_grad_enabled() and (routed.requires_grad or shared.requires_grad or gate_logit.requires_grad):
        return _SharedAddFn.apply(fwd, routed, shared, gate_logit)
    with torch.no_grad():
        return fwd(routed, shared, gate_logit)


def shared_add_triton(routed, shared, gate_logit) -> torch.Tensor:
    """``routed + round(round(sigmoid(gate_logit)) * shared)`` in Triton."""
    return _shared_add(_shared_add_triton_fwd, routed, shared, gate_logit, True)


def shared_add_torch(routed, shared, gate_logit) -> torch.Tensor:
    """The same with ``_torch_math.sigmoid`` (any device)."""
    return _shared_add(_shared_add_torch_fwd, routed, shared, gate_logit, False)


def shared_add_reference(routed, shared, gate_logit) -> torch.Tensor:
    """float64 ``routed + sigmoid(gate_logit) * shared``."""
    return routed.double() + torch.sigmoid(gate_logit.double()) * shared.double()
