"""The four log-prob entry points (logits path and fused lm_head path, triton and torch_ref):
validate, then run the backend's forward, through an autograd Function when a gradient is
needed; one backward for both backends (chunked recompute of the logits)."""
from __future__ import annotations

import torch

from areal_tik.kernels.linear.launcher import linear_fwd
from areal_tik.kernels.linear.torch_ref import matmul_invariant_torch
from areal_tik.kernels.logprobs.checks import check_temperature, validate_hidden, validate_logits
from areal_tik.kernels.logprobs.layout import V_BLOCK, alloc_logits_buffer, chunk_cols
from areal_tik.kernels.logprobs.torch_ref import (
    dlogits_rowwise, dlogits_torch, logits_fwd_torch, token_fwd_torch,
)
from areal_tik.kernels.logprobs.triton_ops import dlogits_triton, logits_fwd_triton, token_fwd_triton


def _token_bwd(hidden, weight, tokens, lse, mz, glp, gent, temperature, chunk, triton_path):
    T, V = hidden.shape[0], weight.shape[0]
    C = chunk or chunk_cols(T, V)
    dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    dw = torch.empty_like(weight)
    buf = alloc_logits_buffer(T, min(C, V), hidden.dtype, hidden.device)
    for c0 in range(0, V, C):
        c1 = min(V, c0 + C)
        w = weight[c0:c1]
        if triton_path:
            lg = linear_fwd(hidden, w, out=buf[:, :c1 - c0])
            dl = dlogits_triton(lg, tokens, lse, mz, glp, gent, c0, temperature)
        else:
            lg = matmul_invariant_torch(hidden, w).to(hidden.dtype)
            dl = dlogits_torch(lg, tokens, lse, mz, glp, gent, c0, temperature)
        dh += (dl @ w).float()
        dw[c0:c1] = dl.t() @ hidden
    return dh.to(hidden.dtype), dw


class _TokenLogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, chunk, triton_path):
        fwd = token_fwd_triton if triton_path else token_fwd_torch
        lp, ent, state = fwd(hidden, weight, tokens, temperature, chunk)
        lse = state[:, 0] + torch.log(state[:, 1])
        mz = state[:, 2] / state[:, 1]
        ctx.save_for_backward(hidden, weight, tokens, lse, mz)
        ctx.temperature, ctx.chunk, ctx.triton_path = temperature, chunk, triton_path
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, glp, gent):
        hidden, weight, tokens, lse, mz = ctx.saved_tensors
        if glp is None and gent is None:
            return None, None, None, None, None, None
        glp = glp.float().contiguous() if glp is not None else None
        gent = gent.float().contiguous() if gent is not None else None
        dh, dw = _token_bwd(hidden, weight, tokens, lse, mz, glp, gent, ctx.temperature, ctx.chunk, ctx.triton_path)
        return (dh if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None,
                None, None, None, None)


class _LogitsLogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature, triton_path):
        lp, ent, state = (logits_fwd_triton if triton_path else logits_fwd_torch)(logits, tokens, temperature)
        lse = state[:, 0] + torch.log(state[:, 1])
        mz = state[:, 2] / state[:, 1]
        ctx.save_for_backward(logits, tokens, lse, mz)
        ctx.temperature, ctx.triton_path = temperature, triton_path
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, glp, gent):
        logits, tokens, lse, mz = ctx.saved_tensors
        if glp is None and gent is None:
            return None, None, None, None
        # contiguous: the kernel reads them as ptr + row (lp.sum() hands over a stride-0 grad)
        glp = glp.float().contiguous() if glp is not None else None
        gent = gent.float().contiguous() if gent is not None else None
        if ctx.triton_path:  # the token path's kernel, in place on one contiguous copy of the logits
            g = torch.empty_like(logits, memory_format=torch.contiguous_format).copy_(logits)
            return dlogits_triton(g, tokens, lse, mz, glp, gent, 0, ctx.temperature), None, None, None
        return dlogits_rowwise(logits, tokens, lse, mz, glp, gent, ctx.temperature), None, None, None


def _run_logits(logits, tokens, temperature, return_entropy, triton_path):
    temperature = check_temperature(temperature)
    validate_logits(logits, tokens, triton_path)
    if torch.is_grad_enabled() and logits.requires_grad:
        lp, ent = _LogitsLogprobsFn.apply(logits, tokens, temperature, triton_path)
    else:
        lp, ent, _ = (logits_fwd_triton if triton_path else logits_fwd_torch)(logits, tokens, temperature)
    return (lp, ent) if return_entropy else lp


def _run_token(hidden, weight, tokens, temperature, return_entropy, chunk, triton_path):
    temperature = check_temperature(temperature)
    validate_hidden(hidden, weight, tokens, triton_path)
    if chunk is not None and (chunk <= 0 or chunk % V_BLOCK):
        raise ValueError(f"_chunk_cols must be a positive multiple of V_BLOCK={V_BLOCK}, got {chunk}")
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        lp, ent = _TokenLogprobsFn.apply(hidden, weight, tokens, temperature, chunk, triton_path)
    else:
        fwd = token_fwd_triton if triton_path else token_fwd_torch
        lp, ent, _ = fwd(hidden, weight, tokens, temperature, chunk)
    return (lp, ent) if return_entropy else lp


def logprobs_from_logits_triton(logits, tokens, temperature, return_entropy=False):
    """fp32 ``log_softmax(logits.float()/T)[token]`` (+ entropy), fixed vocab blocks (Triton)."""
    return _run_logits(logits, tokens, temperature, return_entropy, True)


def token_logprobs_triton(hidden, lm_head_weight, tokens, temperature, return_entropy=False, _chunk_cols=None):
    """Fused lm_head + log-probs (+ entropy) with bounded logits memory (Triton); see module doc."""
    return _run_token(hidden, lm_head_weight, tokens, temperature, return_entropy, _chunk_cols, True)


def logprobs_from_logits_torch(logits, tokens, temperature, return_entropy=False):
    """torch_ref twin of :func:`logprobs_from_logits_triton` (row-invariant on any device)."""
    return _run_logits(logits, tokens, temperature, return_entropy, False)


def token_logprobs_torch(hidden, lm_head_weight, tokens, temperature, return_entropy=False, _chunk_cols=None):
    """torch_ref twin of :func:`token_logprobs_triton`; bitwise equal to
    ``logprobs_from_logits_torch(linear_torch(hidden, W), tokens, T)``."""
    return _run_token(hidden, lm_head_weight, tokens, temperature, return_entropy, _chunk_cols, False)
