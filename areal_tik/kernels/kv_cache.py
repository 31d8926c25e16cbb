"""Write new K/V rows into the paged KV cache.

``kv_cache_write(k, v, k_cache, v_cache, slot_mapping)``: k/v ``[Tk, Hkv, D]``, caches
``[num_pages, page_size, Hkv, D]`` (contiguous, same dtype as k/v), ``slot_mapping``
int32/int64 ``[Tk]`` with slot = ``page * page_size + offset``; entries ``-1`` (padding
tokens, e.g. CUDA-graph filler) are skipped. A pure copy: cache bits equal input bits,
so it cannot affect the attention contract. In place; returns nothing.
Slots must be distinct (two tokens writing one slot is a race).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from areal_tik.kernels import interpreting

__all__ = ["kv_cache_write_triton", "kv_cache_write_torch", "OPS", "META", "COMPILE_SPECS"]


@triton.jit
def _kv_write_kernel(K, V, KC, VC, SLOT, stride_kt, stride_kh, stride_vt, stride_vh,
                     HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOT + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        ok = offs < HEADS * HEAD_DIM
        h = offs // HEAD_DIM
        d = offs % HEAD_DIM
        k = tl.load(K + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=ok)
        v = tl.load(V + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=ok)
        dst = slot * (HEADS * HEAD_DIM) + offs
        tl.store(KC + dst, k, mask=ok)
        tl.store(VC + dst, v, mask=ok)


def _check(k, v, k_cache, v_cache, slot_mapping, triton_path):
    name = "kv_cache_write"
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"{name}: k/v must be [Tk, Hkv, D] of one shape, got {tuple(k.shape)} / {tuple(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"{name}: caches must be [num_pages, page_size, {k.shape[1]}, {k.shape[2]}], got "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"{name}: dtypes differ: {k.dtype} {v.dtype} {k_cache.dtype} {v_cache.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != (k.shape[0],):
        raise TypeError(f"{name}: slot_mapping must be int32/int64 [{k.shape[0]}], got "
                        f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    devs = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devs) != 1:
        raise ValueError(f"{name}: tensors on different devices {devs}")
    if triton_path:
        if k.device.type != "cuda" and not interpreting():
            raise ValueError(f"{name}: the triton backend needs CUDA tensors (got {k.device})")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError(f"{name}: caches must be contiguous")
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError(f"{name}: k/v must be contiguous in the head dim")


def kv_cache_write_triton(k, v, k_cache, v_cache, slot_mapping):
    """Copy ``k[t], v[t]`` into cache slot ``slot_mapping[t]`` (skip -1). Triton, one program per token."""
    _check(k, v, k_cache, v_cache, slot_mapping, True)
    T, H, D = k.shape
    if T == 0:
        return
    _kv_write_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           HEADS=H, HEAD_DIM=D, BLOCK=triton.next_power_of_2(H * D), num_warps=4)


def kv_cache_write_torch(k, v, k_cache, v_cache, slot_mapping):
    """torch_ref of :func:`kv_cache_write_triton` (index copy; identical cache bits)."""
    _check(k, v, k_cache, v_cache, slot_mapping, False)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kc[slots] = k[keep]
    vc[slots] = v[keep]


OPS = {"kv_cache_write": {"triton": kv_cache_write_triton, "torch_ref": kv_cache_write_torch}}
META = {}


def _specs():
    out = []
    for H, D in ((8, 128), (2, 64)):
        c = dict(HEADS=H, HEAD_DIM=D, BLOCK=triton.next_power_of_2(H * D))
        sig = dict(K="*bf16", V="*bf16", KC="*bf16", VC="*bf16", SLOT="*i64", stride_kt="i32", stride_kh="i32",
                   stride_vt="i32", stride_vh="i32", HEADS="constexpr", HEAD_DIM="constexpr", BLOCK="constexpr")
        out.append(dict(fn=_kv_write_kernel, signature=sig, constexprs=c, num_warps=4))
    return out


COMPILE_SPECS = _specs()
