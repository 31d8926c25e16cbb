"""Pure-PyTorch log-probs: the torch_ref backend (the same fixed-block walk with
``_torch_math.exp/log`` and fixed pairwise trees inside a block, any device), its d logits
(row-blocked for bounded fp32 temporaries) and the float64 accuracy reference."""
from __future__ import annotations

import math

import torch

from areal_tik.kernels import _torch_math as tm
from areal_tik.kernels.linear.torch_ref import matmul_invariant_torch
from areal_tik.kernels.logprobs.layout import V_BLOCK, init_state, chunk_cols
from areal_tik.kernels.rms_norm import tree_sum_lastdim


def _lse_update_torch(lg, tokens, state, c0, c1, temperature):
    """torch_ref block walk over absolute columns [c0, c1) of ``lg`` (column 0 = c0)."""
    m, s, t, ztok = state.unbind(1)
    T = lg.shape[0]
    for b0 in range(c0, c1, V_BLOCK):
        b1 = min(b0 + V_BLOCK, c1)
        z = lg[:, b0 - c0:b1 - c0].float() / temperature
        if b1 - b0 < V_BLOCK:
            z = torch.cat([z, z.new_full((T, V_BLOCK - (b1 - b0)), -math.inf)], 1)
        mn = torch.maximum(m, z.max(dim=1).values)
        finite = z > -math.inf
        e = torch.where(finite, tm.exp(torch.where(finite, z - mn[:, None], 0.0)), 0.0)
        alpha = torch.where(m > -math.inf, tm.exp(torch.where(m > -math.inf, m - mn, 0.0)), 0.0)
        s = s * alpha + tree_sum_lastdim(e)
        t = t * alpha + tree_sum_lastdim(torch.where(e > 0, e * z, 0.0))
        m = mn
    tl_ = tokens.long()
    inside = (tl_ >= c0) & (tl_ < c1)
    idx = torch.where(inside, tl_ - c0, 0)
    zt = lg.gather(1, idx[:, None])[:, 0].float() / temperature
    ztok = torch.where(inside, zt, ztok)
    return torch.stack([m, s, t, ztok], 1)


def _finalize_torch(state):
    m, s, t, ztok = state.unbind(1)
    lse = m + tm.log(s)
    return ztok - lse, lse - t / s


def logits_fwd_torch(logits, tokens, temperature):
    T, V = logits.shape
    state = _lse_update_torch(logits, tokens, init_state(T, logits.device), 0, V, temperature)
    lp, ent = _finalize_torch(state)
    return lp, ent, state


def token_fwd_torch(hidden, weight, tokens, temperature, chunk):
    T, V = hidden.shape[0], weight.shape[0]
    C = chunk or chunk_cols(T, V)
    state = init_state(T, hidden.device)
    for c0 in range(0, V, C):
        c1 = min(V, c0 + C)
        lg = matmul_invariant_torch(hidden, weight[c0:c1]).to(hidden.dtype)
        state = _lse_update_torch(lg, tokens, state, c0, c1, temperature)
    lp, ent = _finalize_torch(state)
    return lp, ent, state


def dlogits_torch(lg, tokens, lse, mz, glp, gent, c0, temperature):
    z = lg.float() / temperature
    p = torch.exp(z - lse[:, None])
    g = torch.zeros_like(z)
    if glp is not None:
        cols = torch.arange(c0, c0 + lg.shape[1], device=lg.device)
        onehot = (cols[None, :] == tokens.long()[:, None]).float()
        g = g + glp[:, None] * (onehot - p)
    if gent is not None:
        g = g - gent[:, None] * p * (z - mz[:, None])
    return (g / temperature).to(lg.dtype)


# fp32 temporaries of dlogits_torch per row block: ~6 x rows x V x 4 bytes (about 3.6 GiB at V=151936)
_DLOGITS_ROW_BLOCK = 1024


def dlogits_rowwise(lg, tokens, lse, mz, glp, gent, temperature):
    """d loss / d logits for a [T, V] logits tensor, written block of rows by block of rows into one
    output of the logits' dtype. Each row's gradient depends only on that row, so the blocking changes
    no bits; it bounds the fp32 temporaries (a 16K-token micro-batch at V=151936 otherwise needs ~60 GiB,
    measured as an OOM in the 1.5B GRPO run on the H200)."""
    out = torch.empty_like(lg)
    for r0 in range(0, lg.shape[0], _DLOGITS_ROW_BLOCK):
        r1 = min(lg.shape[0], r0 + _DLOGITS_ROW_BLOCK)
        out[r0:r1] = dlogits_torch(lg[r0:r1], tokens[r0:r1], lse[r0:r1], mz[r0:r1],
                                    glp[r0:r1] if glp is not None else None,
                                    gent[r0:r1] if gent is not None else None, 0, temperature)
    return out


def logprobs_reference(logits, tokens, temperature):
    """float64 ``(logp, entropy)`` from the given logits."""
    z = logits.double() / float(temperature)
    lsm = torch.log_softmax(z, -1)
    lp = lsm.gather(1, tokens.long()[:, None])[:, 0]
    ent = -(lsm.exp() * lsm).sum(-1)
    return lp, ent
