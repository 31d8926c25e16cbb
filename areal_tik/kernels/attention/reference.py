"""Float64 causal GQA attention: the accuracy reference every implementation is measured against; and
:func:`paged_case`, packed sequences with the same keys on shuffled pages of a poisoned cache (the inputs that
check a paged entry against the packed one)."""
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


def paged_case(lens, page, seed, d=128, hq=4, hkv=2, fill=float("nan"), device="cpu"):
    """Random bf16 sequences of ``lens`` tokens, packed and paged: ``(q, k, v, k_cache, v_cache, block_table,
    cu_seqlens, seqlens)``. Each sequence's keys/values sit on its own shuffled pages of caches
    ``[pages + 3, page, hkv, d]`` whose every other slot holds ``fill`` (NaN: a kernel that reads past a sequence's
    keys shows it); ``block_table`` has one spare column. Same ``seed``, same tensors."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g).bfloat16() for h in (hq, hkv, hkv))
    pages = [-(-n // page) for n in lens]
    order = torch.randperm(sum(pages) + 3, generator=g)[:sum(pages)].to(torch.int32)
    kc = torch.full((sum(pages) + 3, page, hkv, d), fill).bfloat16()
    vc = kc.clone()
    table = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
    at = t0 = 0
    for i, n in enumerate(lens):
        table[i, :pages[i]] = order[at:at + pages[i]]
        pos = torch.arange(n)
        slots = table[i].long()[pos // page] * page + pos % page
        kc.view(-1, hkv, d)[slots] = k[t0:t0 + n]
        vc.view(-1, hkv, d)[slots] = v[t0:t0 + n]
        at, t0 = at + pages[i], t0 + n
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return [x.to(device) for x in (q, k, v, kc, vc, table, cu, torch.tensor(lens, dtype=torch.int32))]
