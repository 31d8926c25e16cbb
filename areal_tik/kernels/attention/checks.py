"""Argument validation of the attention pair, the one module every implementation (Triton, csrc, fa3,
torch_ref) calls: one message per mistake, raised before any launch. ``triton_path``: the Triton kernels'
own needs (CUDA tensors or the interpreter, contiguous caches); ``contiguous_caches``: kernels that read the
caches by raw strides (Triton, csrc)."""
from __future__ import annotations

import math

import torch

from areal_tik.kernels import interpreting
from areal_tik.kernels.attention import tuning as T

__all__ = ["softmax_scales", "check_window", "check_varlen", "check_paged"]


def softmax_scales(scale, head_dim) -> tuple[float, float]:
    """(scale, scale*log2(e)) computed one way for every entry point."""
    s = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"attention: scale must be a positive finite number, got {scale!r}")
    return s, s * T.LOG2E


def check_window(window_size):
    if window_size is not None and tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"attention: sliding windows are not supported (window_size={window_size!r}); "
                                  "only full causal attention")


def _check_qkv(q, k, v, name, triton_path):
    for t, nm in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {nm} must be a tensor")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name}: {nm} must be bfloat16, got {t.dtype}")
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} differ in layout")
    D = q.shape[-1]
    if D not in T.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{name}: head dim {D} unsupported; supported: {T.SUPPORTED_HEAD_DIMS}")
    if k.shape[-1] != D:
        raise ValueError(f"{name}: k/v head dim {k.shape[-1]} != q head dim {D}")
    hq, hkv = q.shape[1], k.shape[-2]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"{name}: Hq={hq} must be a multiple of Hkv={hkv}")
    devs = {q.device, k.device, v.device}
    if len(devs) != 1:
        raise ValueError(f"{name}: q, k, v on different devices {devs}")
    if triton_path and q.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name}: the triton backend needs CUDA tensors (got {q.device}); use backend='torch_ref'")
    for t, nm in ((q, "q"), (k, "k"), (v, "v")):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {nm} must be contiguous in the head dim")
    return D, hq, hkv


def _check_index(t, nm, name, device, dims=1):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dims:
        raise TypeError(f"{name}: {nm} must be an int32 tensor with {dims} dim(s), got "
                        f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if t.device != device:
        raise ValueError(f"{name}: {nm} on {t.device}, expected {device}")


def check_varlen(q, k, v, cu_seqlens, max_seqlen, triton_path):
    D, hq, hkv = _check_qkv(q, k, v, "attention_varlen", triton_path)
    if k.dim() != 3 or k.shape[0] != q.shape[0]:
        raise ValueError(f"attention_varlen: k/v must be [T, Hkv, D] with T={q.shape[0]}, got {tuple(k.shape)}")
    _check_index(cu_seqlens, "cu_seqlens", "attention_varlen", q.device)
    if cu_seqlens.shape[0] < 1:
        raise ValueError("attention_varlen: cu_seqlens needs at least one entry")
    if int(max_seqlen) < 0:
        raise ValueError("attention_varlen: max_seqlen must be >= 0")
    return D, hq, hkv


def check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q, triton_path,
                contiguous_caches=None):
    name = "attention_paged"
    D, hq, hkv = _check_qkv(q, k_cache, v_cache, name, triton_path)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: caches must be [num_pages, page_size, Hkv, D] of one shape, got "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    ps = k_cache.shape[1]
    if ps < 16 or ps > 256 or ps & (ps - 1):
        raise ValueError(f"{name}: page size {ps} must be a power of two in 16..256")
    if (triton_path if contiguous_caches is None else contiguous_caches) and not (
            k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{name}: caches must be contiguous")
    _check_index(block_table, "block_table", name, q.device, dims=2)
    _check_index(cu_seqlens_q, "cu_seqlens_q", name, q.device)
    _check_index(seqlens_k, "seqlens_k", name, q.device)
    B = cu_seqlens_q.shape[0] - 1
    if seqlens_k.shape[0] != B or block_table.shape[0] < B:
        raise ValueError(f"{name}: {B} sequences but seqlens_k has {seqlens_k.shape[0]} entries and "
                         f"block_table {block_table.shape[0]} rows")
    if int(max_seqlen_q) < 0:
        raise ValueError(f"{name}: max_seqlen_q must be >= 0")
    return D, hq, hkv, ps, B
