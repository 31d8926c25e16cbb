"""Triton backward of the causal varlen attention (flash-attention-2 style recompute from the saved
output and base-2 log-sum-exp): a dK/dV kernel and a dQ kernel, no atomics, so the gradient bits
are the same on every run (not invariant to the batch: the backward is outside the contract)."""
from __future__ import annotations

import triton
import triton.language as tl

from areal_tik.kernels import interpreting
from areal_tik.kernels.attention import tuning as T
from areal_tik.kernels.attention import workspace as W

@triton.jit
def _bwd_load_q_rows(Q, DO, LSE, DELTA, s0, offs_m, m_ok, offs_d, hq, stride_qt, stride_qh, stride_lt):
    """q, dO, lse, delta of query rows ``offs_m`` of one sequence and q head (rows past the
    sequence read 0) and their q/dO offsets."""
    qrow = (s0 + offs_m).to(tl.int64)
    q_off = qrow[:, None] * stride_qt + hq * stride_qh + offs_d[None, :]
    q = tl.load(Q + q_off, mask=m_ok[:, None], other=0.0)
    do = tl.load(DO + q_off, mask=m_ok[:, None], other=0.0)
    lse = tl.load(LSE + qrow * stride_lt + hq, mask=m_ok, other=0.0)
    dl = tl.load(DELTA + qrow * stride_lt + hq, mask=m_ok, other=0.0)
    return q, do, lse, dl, q_off


@triton.jit
def _bwd_kv_offsets(s0, offs_n, offs_d, hk, stride_kt, stride_kh):
    krow = (s0 + offs_n).to(tl.int64)
    return krow[:, None] * stride_kt + hk * stride_kh + offs_d[None, :]


@triton.jit
def _bwd_dkdv_step(q_ptrs_base, Q, DO, LSE, DELTA, k, v, dk, dv, s0, n, start_m, offs_n, offs_d, hq,
                   qk_scale, stride_qt, stride_qh, stride_lt,
                   BLOCK_M: tl.constexpr, MASKED: tl.constexpr):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n
    q, do, lse, dl, q_off = _bwd_load_q_rows(Q, DO, LSE, DELTA, s0, offs_m, m_ok, offs_d, hq,
                                             stride_qt, stride_qh, stride_lt)
    sT = tl.dot(k, tl.trans(q)) * qk_scale
    pT = tl.exp2(sT - lse[None, :])
    if MASKED:
        pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
    # rows past the sequence load q = do = 0, lse = delta = 0: p = 1 finite, and both
    # contributions below are exactly 0, so they need no mask
    dv = tl.dot(pT.to(tl.bfloat16), do, dv)
    dpT = tl.dot(v, tl.trans(do))
    dsT = pT * (dpT - dl[None, :])
    dk = tl.dot(dsT.to(tl.bfloat16), q, dk)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU, qk_scale, sm_scale,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK, dV for one KV block of one sequence and one KV head (sums its GROUP q heads).
    q/do/o share strides (stride_q*), k/v/dk/dv share strides (stride_k*). BLOCK_N is a
    multiple of BLOCK_M: the query blocks overlapping the key block are masked, later ones not.
    Grid (kv-blocks, B, Hkv), kv-blocks run first-first (the longest loops start first)."""
    pid_n = tl.program_id(0)
    seq = tl.program_id(1)
    hk = tl.program_id(2)
    s0 = tl.load(CU + seq)
    n = tl.load(CU + seq + 1) - s0
    start_n = pid_n * BLOCK_N
    if start_n < n:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n
        offs_d = tl.arange(0, HEAD_DIM)
        kv_off = _bwd_kv_offsets(s0, offs_n, offs_d, hk, stride_kt, stride_kh)
        k = tl.load(K + kv_off, mask=n_ok[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=n_ok[:, None], other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        diag_end = tl.minimum(start_n + BLOCK_N, n)
        for g in range(0, GROUP):
            hq = hk * GROUP + g
            for start_m in range(start_n, diag_end, BLOCK_M):
                dk, dv = _bwd_dkdv_step(0, Q, DO, LSE, DELTA, k, v, dk, dv, s0, n, start_m, offs_n, offs_d, hq,
                                        qk_scale, stride_qt, stride_qh, stride_lt, BLOCK_M, True)
            for start_m in range(start_n + BLOCK_N, n, BLOCK_M):
                dk, dv = _bwd_dkdv_step(0, Q, DO, LSE, DELTA, k, v, dk, dv, s0, n, start_m, offs_n, offs_d, hq,
                                        qk_scale, stride_qt, stride_qh, stride_lt, BLOCK_M, False)
        tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok[:, None])
        tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=n_ok[:, None])


@triton.jit
def _bwd_dq_step(K, V, q, do, lse, dl, dq, s0, n, start_n, offs_m, offs_d, hk, qk_scale, stride_kt, stride_kh,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """dq += dS K over one key block; MASKED: a diagonal block (causal mask and sequence end)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    kv_off = _bwd_kv_offsets(s0, offs_n, offs_d, hk, stride_kt, stride_kh)
    if MASKED:
        k = tl.load(K + kv_off, mask=n_ok[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=n_ok[:, None], other=0.0)
    else:
        k = tl.load(K + kv_off)
        v = tl.load(V + kv_off)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        ok = (offs_n[None, :] <= offs_m[:, None]) & n_ok[None, :]
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
    else:
        p = tl.exp2(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - dl[:, None])
    return tl.dot(ds.to(tl.bfloat16), k, dq)


@triton.jit
def attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, qk_scale, sm_scale,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ for BLOCK_M queries of one sequence and one q head (BLOCK_M a multiple of
    BLOCK_N: key blocks before the query block unmasked, the diagonal ones masked).
    Grid (Hq, m-blocks, B), m-blocks last-first."""
    hq = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tl.program_id(2)
    hk = hq // GROUP
    s0 = tl.load(CU + seq)
    n = tl.load(CU + seq + 1) - s0
    start_m = pid_m * BLOCK_M
    if start_m < n:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < n
        offs_d = tl.arange(0, HEAD_DIM)
        q, do, lse, dl, q_off = _bwd_load_q_rows(Q, DO, LSE, DELTA, s0, offs_m, m_ok, offs_d, hq,
                                                 stride_qt, stride_qh, stride_lt)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start_n in range(0, start_m, BLOCK_N):
            dq = _bwd_dq_step(K, V, q, do, lse, dl, dq, s0, n, start_n, offs_m, offs_d, hk, qk_scale,
                              stride_kt, stride_kh, BLOCK_N, False)
        end_n = tl.minimum(n, start_m + BLOCK_M)
        for start_n in range(start_m, end_n, BLOCK_N):
            dq = _bwd_dq_step(K, V, q, do, lse, dl, dq, s0, n, start_n, offs_m, offs_d, hk, qk_scale,
                              stride_kt, stride_kh, BLOCK_N, True)
        tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_ok[:, None])


def _bwd_tiles(D):
    if interpreting():
        return dict(BLOCK_M1=16, BLOCK_N1=32, BLOCK_M2=32, BLOCK_N2=16, num_warps=4, num_stages=1)
    t = dict(T._BWD_GPU[D])
    if t["BLOCK_N1"] % t["BLOCK_M1"] or t["BLOCK_M2"] % t["BLOCK_N2"]:
        raise ValueError(f"attention backward tiles {t}: BLOCK_N1 must be a multiple of BLOCK_M1 and "
                         "BLOCK_M2 a multiple of BLOCK_N2")
    return t


def varlen_backward(q, k, v, out, lse, cu_seqlens, max_seqlen, sm_scale, qk_scale, dout):
    """dq, dk, dv of the causal varlen attention from its saved inputs, bf16 output ``out`` and base-2
    log-sum-exp ``lse`` ``[T, Hq]`` fp32 (scores scaled by ``qk_scale`` = ``sm_scale`` * log2(e)): the
    flash-attention-2 style Triton recompute (correct, not bit-invariant). Used by the Triton forward's
    autograd and by the CUDA forward's (csrc writes the same lse)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dout = dout.contiguous()
    D, hq, hkv = q.shape[-1], q.shape[1], k.shape[1]
    delta = (dout.float() * out.float()).sum(-1).contiguous()
    dq, dk, dv = W.alloc(q.shape, q.dtype, q.device), W.alloc(k.shape, k.dtype, k.device), \
        W.alloc(v.shape, v.dtype, v.device)
    t = _bwd_tiles(D)
    B = cu_seqlens.shape[0] - 1
    if B > 0 and max_seqlen > 0:
        common = dict(GROUP=hq // hkv, HEAD_DIM=D, num_warps=t["num_warps"], num_stages=t["num_stages"])
        attn_bwd_dkdv_kernel[(triton.cdiv(max_seqlen, t["BLOCK_N1"]), B, hkv)](
            q, k, v, dout, lse, delta, dk, dv, cu_seqlens, qk_scale, sm_scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
            BLOCK_M=t["BLOCK_M1"], BLOCK_N=t["BLOCK_N1"], **common)
        attn_bwd_dq_kernel[(hq, triton.cdiv(max_seqlen, t["BLOCK_M2"]), B)](
            q, k, v, dout, lse, delta, dq, cu_seqlens, qk_scale, sm_scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
            BLOCK_M=t["BLOCK_M2"], BLOCK_N=t["BLOCK_N2"], **common)
    else:
        dq.zero_(), dk.zero_(), dv.zero_()
    return dq, dk, dv
