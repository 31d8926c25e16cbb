"""Float64 causal GQA attention: the accuracy reference every implementation is measured against."""
from __future__ import annotations

import math

import torch

def attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k=None, scale=None):
    """Float64 causal GQA attention. Sequence i has queries ``q[cu_q[i]:cu_q[i+1]]`` (its
    last positions) and keys/values ``k[cu_k[i]:cu_k[i+1]]`` (all its positions from 0);
    ``cu_seqlens_k`` defaults to ``cu_seqlens_q`` (self-attention). Returns float64."""
    cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    sm = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        n, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if n == 0:
            continue
        qd = q[cq[i]:cq[i + 1]].double().transpose(0, 1)
        kd = k[ck[i]:ck[i + 1]].double().repeat_interleave(g, 1).transpose(0, 1)
        vd = v[ck[i]:ck[i + 1]].double().repeat_interleave(g, 1).transpose(0, 1)
        s = (qd @ kd.transpose(1, 2)) * sm
        pos = torch.arange(lk - n, lk, device=q.device)
        mask = torch.arange(lk, device=q.device)[None, :] <= pos[:, None]
        s = s.masked_fill(~mask, -math.inf)
        out[cq[i]:cq[i + 1]] = (torch.softmax(s, -1) @ vd).transpose(0, 1)
    return out
