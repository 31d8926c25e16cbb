"""Triton forwards of the log-prob op: launching the LSE walk (refusing views that break its
alignment promise), the logits path, the fused lm_head path (``linear``'s kernel on vocab
chunks into one aligned buffer) and the d logits kernel of the backward."""
from __future__ import annotations

import torch
import triton

from areal_tik.kernels.linear.launcher import linear_fwd
from areal_tik.kernels.logprobs.layout import (
    LSE_WARPS, ROW_ALIGN, V_BLOCK, is_aligned, init_state, alloc_logits_buffer, chunk_cols,
)
from areal_tik.kernels.logprobs.triton_kernels import dlogits_kernel, lse_blocks_kernel


def _lse_launch(lg, tokens, state, lp, ent, c0, c1, temperature, last):
    T = lg.shape[0]
    if T == 0:
        return
    if not is_aligned(lg):
        # never launch with a false multiple_of promise (misaligned vector loads crash the
        # context); callers pass padded buffers or copy first
        raise ValueError(f"LSE kernel needs a 16-byte aligned base and a row stride that is a multiple of "
                         f"{ROW_ALIGN} elements; got data_ptr % 16 = {lg.data_ptr() % 16}, stride {lg.stride(0)}")
    lse_blocks_kernel[(T,)](lg, lg.stride(0), tokens, state, lp, ent, c0, c1, temperature, int(last),
                             V_BLOCK=V_BLOCK, num_warps=LSE_WARPS)


def logits_fwd_triton(logits, tokens, temperature):
    T, V = logits.shape
    if not is_aligned(logits):  # same kernel specialisation as token_logprobs' aligned buffers
        pad = alloc_logits_buffer(T, V, logits.dtype, logits.device)
        pad.copy_(logits)
        logits = pad
    state = init_state(T, logits.device)
    lp = torch.empty(T, dtype=torch.float32, device=logits.device)
    ent = torch.empty_like(lp)
    _lse_launch(logits, tokens, state, lp, ent, 0, V, temperature, True)
    return lp, ent, state


def dlogits_triton(lg, tokens, lse, mz, glp, gent, c0, temperature):
    T, n = lg.shape
    if T == 0 or n == 0:
        return lg
    blk = 2048
    dlogits_kernel[(T, triton.cdiv(n, blk))](
        lg, lg.stride(0), tokens, lse, mz, glp if glp is not None else lse, gent if gent is not None else lse,
        c0, n, temperature, HAS_GLP=glp is not None, HAS_GENT=gent is not None, BLOCK=blk, num_warps=8)
    return lg


def token_fwd_triton(hidden, weight, tokens, temperature, chunk):
    T, V = hidden.shape[0], weight.shape[0]
    C = chunk or chunk_cols(T, V)
    state = init_state(T, hidden.device)
    lp = torch.empty(T, dtype=torch.float32, device=hidden.device)
    ent = torch.empty_like(lp)
    buf = alloc_logits_buffer(T, min(C, V), hidden.dtype, hidden.device)
    for c0 in range(0, V, C):
        c1 = min(V, c0 + C)
        lg = linear_fwd(hidden, weight[c0:c1], out=buf[:, :c1 - c0])
        _lse_launch(lg, tokens, state, lp, ent, c0, c1, temperature, c1 == V)
    return lp, ent, state
