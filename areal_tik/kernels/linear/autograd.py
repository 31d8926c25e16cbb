"""Input validation and the autograd wrapper shared by both forwards of the linear op (Triton
and torch_ref): flatten to 2-D, run the forward, and one torch-matmul backward for both."""
from __future__ import annotations

import torch

from areal_tik.kernels._dense_common import (
    as_2d,
    check_dtype, check_last_dim_contiguous, check_contiguous, check_same_device, check_same_dtype,
    check_triton_device,
)


def validate_linear(x, weight, bias, triton_path: bool):
    """The linear op's argument checks (one line each): dtypes, shapes, contiguity, devices."""
    check_dtype("x", x)
    check_dtype("weight", weight)
    check_same_dtype(x=x, weight=weight)
    if bias is not None:
        check_dtype("bias", bias)
        check_same_dtype(x=x, bias=bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        check_contiguous("bias", bias)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x last dim {tuple(x.shape)[-1:]} does not match weight K={weight.shape[1]}")
    check_contiguous("weight", weight)
    check_last_dim_contiguous("x", x)
    if triton_path:
        check_triton_device(("x", x), ("weight", weight), ("bias", bias))
    else:
        check_same_device(("x", x), ("weight", weight), ("bias", bias))


def _linear_backward(ctx, dy, x2, w):
    """Gradients of ``_LinearFn`` (inputs ``fwd, x2, w, b``: ``needs_input_grad[1:]``)."""
    dx = dw = db = None
    dy = dy.contiguous()
    if ctx.needs_input_grad[1]:
        dx = (dy @ w).to(x2.dtype)
    if ctx.needs_input_grad[2]:
        dw = (dy.t() @ x2).to(w.dtype)
    if ctx.has_bias and ctx.needs_input_grad[3]:
        db = dy.float().sum(0).to(dy.dtype)
    return dx, dw, db


class _LinearFn(torch.autograd.Function):
    """Autograd around either forward (``fwd``: Triton or torch_ref); one backward for both."""

    @staticmethod
    def forward(ctx, fwd, x2, w, b):
        ctx.save_for_backward(x2, w)
        ctx.has_bias = b is not None
        return fwd(x2, w, b)

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        return (None, *_linear_backward(ctx, dy, x2, w))


def linear_2d(fwd, x, weight, bias, triton_path: bool) -> torch.Tensor:
    """Validate, flatten to 2-D, run ``fwd`` (through autograd when a grad is needed)."""
    validate_linear(x, weight, bias, triton_path=triton_path)
    x2 = as_2d(x, "[M, K]")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        y = _LinearFn.apply(fwd, x2, weight, bias)
    else:
        y = fwd(x2, weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
