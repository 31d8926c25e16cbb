"""The Triton entry points: ``attention_varlen_triton`` (R1 training forward, autograd) and
``attention_paged_triton`` (R2-R4 over the paged cache; decode is split-KV in one launch), their
launchers and tile choice."""
from __future__ import annotations

import torch
import triton

from areal_tik.kernels import interpreting
from areal_tik.kernels.attention import tuning as T
from areal_tik.kernels.attention import workspace as W
from areal_tik.kernels.attention.checks import check_paged, check_varlen, check_window, softmax_scales
from areal_tik.kernels.attention.flash_backward import varlen_attention_backward
from areal_tik.kernels.attention.triton_kernels import attn_decode_kernel, attn_fwd_kernel

def _fwd_tiles(D):
    if interpreting():
        return dict(BLOCK_M=T._INTERP_BLOCK_M, num_warps=4, num_stages=1, FLAT=T._FWD_GPU[D].get("FLAT", 1))
    return dict(T._FWD_GPU[D])


def _launch_fwd(q, k, v, out, lse, block_table, cu_q, seqlens_k, max_seqlen_q, qk_scale, paged, page_size,
                block_m=None):
    D, hq, hkv = q.shape[-1], q.shape[1], k.shape[-2]
    bn, part = T._cfg()
    tiles = _fwd_tiles(D)
    if block_m is not None:
        tiles["BLOCK_M"] = block_m
    B = cu_q.shape[0] - 1
    if B == 0 or max_seqlen_q == 0:
        return
    grid = (hq, triton.cdiv(max_seqlen_q, tiles["BLOCK_M"]), B)
    if paged:
        kk, vv = k.view(-1, hkv, D), v.view(-1, hkv, D)
        bt, sk, sbt = block_table, seqlens_k, block_table.stride(0)
    else:
        kk, vv, bt, sk, sbt = k, v, cu_q, cu_q, 0
    lse_t = lse if lse is not None else out
    attn_fwd_kernel[grid](
        q, kk, vv, out, lse_t, bt, cu_q, sk, qk_scale,
        q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), vv.stride(0), vv.stride(1),
        out.stride(0), out.stride(1), (lse.stride(0) if lse is not None else 0), sbt,
        GROUP=hq // hkv, HEAD_DIM=D, BLOCK_M=tiles["BLOCK_M"], BLOCK_N=bn, PARTITION=part,
        PAGED=paged, PAGE_SIZE=page_size, STORE_LSE=lse is not None, FLAT=int(tiles.get("FLAT", 1)),
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"], enable_fp_fusion=False)


def _varlen_fwd(q, k, v, cu_seqlens, max_seqlen, qk_scale, want_lse, block_m=None):
    out = W.alloc(q.shape, q.dtype, q.device)
    lse = W.alloc((q.shape[0], q.shape[1]), torch.float32, q.device) if want_lse else None
    _launch_fwd(q, k, v, out, lse, None, cu_seqlens, None, int(max_seqlen), qk_scale, False, 16, block_m)
    return out, lse


class AttentionVarlenFunction(torch.autograd.Function):
    """Autograd for the Triton varlen forward; backward: :mod:`areal_tik.kernels.attention.flash_backward` (the
    Triton flash-attention-2 recompute :func:`varlen_backward`, or PyTorch's flash backward kernel, on the
    saved output and lse; dq/dk/dv correct, not bit-invariant)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale):
        sm_scale, qk_scale = softmax_scales(scale, q.shape[-1])
        out, lse = _varlen_fwd(q, k, v, cu_seqlens, max_seqlen, qk_scale, True)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.sm_scale, ctx.qk_scale = int(max_seqlen), sm_scale, qk_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = varlen_attention_backward(q, k, v, out, lse, cu, ctx.max_seqlen, ctx.sm_scale, ctx.qk_scale,
                                               dout)
        return dq, dk, dv, None, None, None


def attention_varlen_triton(q, k, v, cu_seqlens, max_seqlen, scale=None, window_size=None):
    """R1 packed causal GQA attention (Triton). q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` bf16,
    ``cu_seqlens`` int32 ``[B+1]``, ``max_seqlen`` >= the longest segment (host int).
    Returns ``[T, Hq, D]`` bf16. Each token's output bits depend only on its sequence's
    tokens up to it and equal ``attention_paged`` for the same position (module docstring).
    Autograd when any input requires grad; the output bits are the same either way."""
    check_window(window_size)
    check_varlen(q, k, v, cu_seqlens, max_seqlen, True)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return AttentionVarlenFunction.apply(q, k, v, cu_seqlens, int(max_seqlen), scale)
    _, qk_scale = softmax_scales(scale, q.shape[-1])
    return _varlen_fwd(q, k, v, cu_seqlens, max_seqlen, qk_scale, False)[0]


def attention_paged_triton(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q,
                           scale=None, window_size=None):
    """R2 prefill / R3 chunked prefill / R4 decode over the paged KV cache (Triton).

    q ``[Tq, Hq, D]`` bf16; caches ``[num_pages, page_size, Hkv, D]`` bf16 contiguous;
    ``block_table`` int32 ``[B, max_pages]``; ``cu_seqlens_q`` int32 ``[B+1]``;
    ``seqlens_k`` int32 ``[B]`` (includes the queries, which are each sequence's last
    positions); ``max_seqlen_q`` host int. ``max_seqlen_q == 1`` takes the split-KV decode
    path (GQA heads packed in MMA rows, partitions of ``KV_PARTITION`` tokens merged in
    ascending order by the last partition program of the same launch), else the prefill
    kernel; both give the same bits per query position. No host synchronisation; decode
    uses a persistent per-device counter buffer that returns to zero after every launch
    (CUDA-graph safe; two decode launches must not run concurrently on one device)."""
    check_window(window_size)
    D, hq, hkv, ps, B = check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k,
                                      max_seqlen_q, True)
    _, qk_scale = softmax_scales(scale, D)
    out = W.alloc(q.shape, q.dtype, q.device)
    if B == 0 or int(max_seqlen_q) == 0:
        return out
    if int(max_seqlen_q) == 1:
        _decode(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, out, qk_scale)
    else:
        _launch_fwd(q, k_cache, v_cache, out, None, block_table, cu_seqlens_q, seqlens_k, int(max_seqlen_q),
                    qk_scale, True, ps)
    return out


def _decode(q, k_cache, v_cache, block_table, cu_q, seqlens_k, out, qk_scale):
    D, hq, hkv, ps = q.shape[-1], q.shape[1], k_cache.shape[2], k_cache.shape[1]
    bn, part = T._cfg()
    B = cu_q.shape[0] - 1
    group = hq // hkv
    # interpreter: tiny launch settings, but the configured HSPLIT (a launch choice the CPU
    # tests check for bit-equality; the defaults keep HSPLIT=1)
    cfg = (dict(num_warps=4, num_stages=1, HSPLIT=T._DEC_GPU.get("HSPLIT", 1)) if interpreting()
           else dict(T._DEC_GPU))
    hsplit = int(cfg.get("HSPLIT", 1))
    if hsplit < 1 or group % hsplit:
        hsplit = 1                     # not bit-defining: fall back for groups it does not divide
    block_h = max(16, triton.next_power_of_2(group // hsplit))
    n_parts = max(1, triton.cdiv(block_table.shape[1] * ps, part))
    dev = q.device
    wm = W.alloc((B * hq * n_parts,), torch.float32, dev)
    wl = W.alloc((B * hq * n_parts,), torch.float32, dev)
    wa = W.alloc((B * hq * n_parts * D,), torch.float32, dev)
    cnt = W.counters(B * hkv * hsplit, dev)
    kk, vv = k_cache.view(-1, hkv, D), v_cache.view(-1, hkv, D)
    attn_decode_kernel[(n_parts, hkv * hsplit, B)](
        q, kk, vv, block_table, cu_q, seqlens_k, out, wm, wl, wa, cnt, qk_scale,
        q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), vv.stride(0), vv.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), n_parts, hq, hkv * hsplit,
        GROUP=group, HEAD_DIM=D, BLOCK_H=block_h, BLOCK_N=bn, PARTITION=part, PAGE_SIZE=ps, HSPLIT=hsplit,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=False)
