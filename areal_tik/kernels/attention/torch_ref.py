"""The torch_ref attention: the same contract on a CPU with its own bits, built from exactly-rounded
ops in a fixed order (two-pass exact-max softmax, fixed-tree sums inside BLOCK_N blocks, ascending
across blocks, deterministic exp from ``_torch_math``). It does not equal the Triton bits."""
from __future__ import annotations

import math

import torch

from areal_tik.kernels import _torch_math
from areal_tik.kernels.attention import tuning as T
from areal_tik.kernels.attention import workspace as W
from areal_tik.kernels.attention.checks import check_paged, check_varlen, check_window, softmax_scales

def _tree_sum_blocks(x: torch.Tensor, dim: int, bn: int) -> torch.Tensor:
    """Sum over ``dim`` (length a multiple of bn): fixed pairwise tree inside each aligned
    block of bn, then ascending over blocks. Zero padding is an exact no-op."""
    x = x.movedim(dim, -1)
    nb = x.shape[-1] // bn
    x = x.reshape(*x.shape[:-1], nb, bn)
    w = bn
    while w > 1:
        w //= 2
        x = x[..., :w] + x[..., w:2 * w]
    x = x[..., 0]
    total = x[..., 0]
    for b in range(1, nb):
        total = total + x[..., b]
    return total


def _torch_attend(q, pos, k, v, scale, bn):
    """q [n, Hq, D] bf16 at absolute positions pos [n]; k/v [Lk, Hkv, D] bf16 = the
    sequence's keys 0..Lk-1 (Lk > max(pos)). Returns fp32 [n, Hq, D] before the bf16 cast."""
    n, hq, D = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    lpad = -(-lk // bn) * bn
    kf = torch.zeros(lpad, hq, D, dtype=torch.float32, device=q.device)
    vf = torch.zeros_like(kf)
    kf[:lk] = k.float().repeat_interleave(g, dim=1)
    vf[:lk] = v.float().repeat_interleave(g, dim=1)
    kT = kf.permute(1, 2, 0)            # [Hq, D, L]
    vT = vf.permute(1, 0, 2)            # [Hq, L, D]
    qf = q.float()
    j = torch.arange(lpad, device=q.device)
    out = torch.empty(n, hq, D, dtype=torch.float32, device=q.device)
    chunk = max(1, (1 << 22) // max(1, hq * lpad * D))
    for c0 in range(0, n, chunk):
        qc, pc = qf[c0:c0 + chunk], pos[c0:c0 + chunk]
        s = torch.zeros(qc.shape[0], hq, lpad, dtype=torch.float32, device=q.device)
        for d in range(D):               # exact products, ascending sum over d
            s = s + qc[:, :, d, None] * kT[None, :, d, :]
        s = s * scale
        valid = (j[None, :] <= pc[:, None])[:, None, :]
        s = torch.where(valid, s, torch.full_like(s, -math.inf))
        m = s.amax(-1, keepdim=True)     # exact
        p = torch.where(valid, _torch_math.exp(s - m), torch.zeros_like(s))
        l = _tree_sum_blocks(p, -1, bn)                                  # [c, Hq]
        acc = _tree_sum_blocks(p[..., None] * vT[None], -2, bn)          # [c, Hq, D]
        out[c0:c0 + qc.shape[0]] = acc / l[..., None]
    return out


class _VarlenTorchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale):
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.scale = scale
        return _varlen_torch_fwd(q, k, v, cu_seqlens, scale)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, cu = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(k, dtype=torch.float32), \
            torch.zeros_like(v, dtype=torch.float32)
        g = q.shape[1] // k.shape[1]
        bounds = cu.tolist()
        for b in range(len(bounds) - 1):
            s0, s1 = bounds[b], bounds[b + 1]
            if s1 == s0:
                continue
            qf = q[s0:s1].float().transpose(0, 1)
            kf = k[s0:s1].float().repeat_interleave(g, 1).transpose(0, 1)
            vf = v[s0:s1].float().repeat_interleave(g, 1).transpose(0, 1)
            do = dout[s0:s1].float().transpose(0, 1)
            n = s1 - s0
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            sc = (qf @ kf.transpose(1, 2)) * ctx.scale
            p = torch.softmax(sc.masked_fill(~mask, -math.inf), -1)
            dvh = p.transpose(1, 2) @ do
            dp = do @ vf.transpose(1, 2)
            ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * ctx.scale
            dq[s0:s1] = (ds @ kf).transpose(0, 1)
            dkh = (ds.transpose(1, 2) @ qf).transpose(0, 1)
            dk[s0:s1] = dkh.reshape(n, k.shape[1], g, -1).sum(2)
            dv[s0:s1] = dvh.transpose(0, 1).reshape(n, k.shape[1], g, -1).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _varlen_torch_fwd(q, k, v, cu_seqlens, scale):
    bn, _ = T._cfg()
    out = W.alloc(q.shape, q.dtype, q.device)
    bounds = cu_seqlens.tolist()
    for b in range(len(bounds) - 1):
        s0, s1 = bounds[b], bounds[b + 1]
        if s1 > s0:
            pos = torch.arange(s1 - s0, device=q.device)
            out[s0:s1] = _torch_attend(q[s0:s1], pos, k[s0:s1], v[s0:s1], scale, bn).to(q.dtype)
    return out


def attention_varlen_torch(q, k, v, cu_seqlens, max_seqlen, scale=None, window_size=None):
    """torch_ref of :func:`attention_varlen_triton`: same layouts and invariance contract,
    its own bits (two-pass exact-max softmax; fixed-tree sums; deterministic exp).
    Autograd through a float32 recompute backward."""
    check_window(window_size)
    check_varlen(q, k, v, cu_seqlens, max_seqlen, False)
    sm_scale, _ = softmax_scales(scale, q.shape[-1])
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _VarlenTorchFunction.apply(q, k, v, cu_seqlens, sm_scale)
    return _varlen_torch_fwd(q, k, v, cu_seqlens, sm_scale)


def _gather_seq_kv(k_cache, v_cache, block_table, i, lk):
    ps = k_cache.shape[1]
    j = torch.arange(lk, device=k_cache.device)
    slots = block_table[i].long()[j // ps] * ps + j % ps
    kc = k_cache.reshape(-1, *k_cache.shape[2:])
    vc = v_cache.reshape(-1, *v_cache.shape[2:])
    return kc[slots], vc[slots]


def attention_paged_torch(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q,
                          scale=None, window_size=None):
    """torch_ref of :func:`attention_paged_triton` (same layouts and contract, own bits;
    bitwise equal to :func:`attention_varlen_torch` for the same query position)."""
    check_window(window_size)
    D, hq, hkv, ps, B = check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k,
                                      max_seqlen_q, False)
    sm_scale, _ = softmax_scales(scale, D)
    bn, _ = T._cfg()
    out = W.alloc(q.shape, q.dtype, q.device)
    cu = cu_seqlens_q.tolist()
    sk = seqlens_k.tolist()
    for i in range(B):
        n = cu[i + 1] - cu[i]
        if n == 0:
            continue
        lk = sk[i]
        if lk < n:
            raise ValueError(f"attention_paged: sequence {i} has {n} queries but seqlens_k={lk}")
        kk, vv = _gather_seq_kv(k_cache, v_cache, block_table, i, lk)
        pos = torch.arange(lk - n, lk, device=q.device)
        out[cu[i]:cu[i + 1]] = _torch_attend(q[cu[i]:cu[i + 1]], pos, kk, vv, sm_scale, bn).to(q.dtype)
    return out
