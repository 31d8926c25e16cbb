"""What the patched HF model injects into the decoder graph (``decoder.py``) per forward: a *step*
with ``rope(q, k, q_norm, k_norm)`` (the per-head norms, when the family has them, then RoPE) and
``attend(attn, q, k, v)`` on flattened tokens.

- :class:`TikRope`: RoPE from the model's fp32 table (``ops.rope_table``), applied with the norms by the
  bound ``qk_norm_rope`` (one launch for q and k) where it computes the bound ``rms_norm``'s and
  ``apply_rope``'s arithmetic, else by those apart. Every tik host uses it (the vLLM plugin's step extends
  it with vLLM's attention).
- :class:`TikStep` (``kernels="tik"``): with an engine context (``attn_context``) the bound
  ``kv_cache_write`` stores this step's K/V in the layer's paged cache and ``attention_paged``
  attends over it; without one (training) ``attention_varlen`` attends over the packed sequences.
- :class:`DefaultStep` (``kernels="default"``, the baseline): HF's RoPE in the model dtype and
  SDPA, made packed-varlen and paged-cache aware.

Steps are dataclasses on purpose: FSDP2 casts the floating tensors of a layer's inputs
(dataclass fields included) to the compute dtype, and the trainer's pre-hook
(``areal/device_model.keep_rope_fp32``) puts the fp32 ``cos``/``sin`` back.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from areal_tik.layers.attn_context import AttentionContext
from areal_tik.layers.default_varlen import packed_causal_attention, sdpa_causal
from areal_tik.layers.modules import TikRMSNorm, fuses_norm_rope

__all__ = ["TikRope", "TikStep", "DefaultStep", "default_cache_write", "default_paged_attention"]


@dataclasses.dataclass
class TikRope:
    """RoPE by the bound ``apply_rope`` from the fp32 table ``cos``/``sin`` ``[max_pos, D]`` at ``positions``
    (int64 ``[T]``)."""

    ops: object
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor

    def rope(self, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None = None,
             k_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-head norms (when given) then RoPE: one ``qk_norm_rope`` launch for q and k where it computes the
        bound ops' arithmetic (``modules.fuses_norm_rope``; tik norms of q's dtype and one eps), else the bound
        ``rms_norm`` and ``apply_rope`` apart."""
        ops, cos, sin, pos = self.ops, self.cos, self.sin, self.positions
        if q_norm is None:
            if fuses_norm_rope(ops):
                return ops.qk_norm_rope(q, k, cos, sin, pos)
        elif (fuses_norm_rope(ops) and isinstance(q_norm, TikRMSNorm) and isinstance(k_norm, TikRMSNorm)
              and q_norm.weight.dtype == q.dtype and k_norm.weight.dtype == q.dtype
              and q_norm.variance_epsilon == k_norm.variance_epsilon):
            return ops.qk_norm_rope(q, k, cos, sin, pos, q_norm.weight, k_norm.weight, q_norm.variance_epsilon)
        else:
            q, k = q_norm(q.contiguous()), k_norm(k.contiguous())
        return ops.apply_rope(q, cos, sin, pos), ops.apply_rope(k, cos, sin, pos)


@dataclasses.dataclass
class TikStep(TikRope):
    """The tik kernels' attention: the engine's paged cache when ``ctx`` is set, else packed varlen over
    ``cu_seqlens`` (int32 ``[S+1]``, training)."""

    ctx: AttentionContext | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0

    def attend(self, attn, q, k, v) -> torch.Tensor:
        ops, ctx = self.ops, self.ctx
        if ctx is not None:
            k_cache, v_cache = ctx.kv_caches[attn.layer_idx]
            ops.kv_cache_write(k, v, k_cache, v_cache, ctx.slot_mapping)
            return ops.attention_paged(q, k_cache, v_cache, ctx.block_table, ctx.cu_seqlens_q, ctx.seqlens_k,
                                       ctx.max_seqlen_q, scale=attn.scaling)
        # v may be a row-strided view of a stacked q/k/v GEMM output (stacking.py)
        return ops.attention_varlen(q, k, v.contiguous(), self.cu_seqlens, self.max_seqlen, scale=attn.scaling)


@dataclasses.dataclass
class DefaultStep:
    """HF's math: its ``apply_rotary_pos_emb`` with its rotary embedding's (cos, sin) ``[B, L, D]`` in the model
    dtype, then SDPA (batched for a plain ``[B, L]`` batch, ``cu_host`` None), packed varlen over ``cu_host``,
    or over the engine's paged cache when ``ctx`` is set."""

    batch: int
    length: int
    position_embeddings: tuple
    apply_rotary_pos_emb: Callable
    ctx: AttentionContext | None = None
    cu_host: list | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0

    def rope(self, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None = None,
             k_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if q_norm is not None:
            q, k = q_norm(q.contiguous()), k_norm(k.contiguous())
        B, L = self.batch, self.length
        hq, hkv, D = q.shape[1], k.shape[1], q.shape[2]
        cos, sin = self.position_embeddings
        qb = q.view(B, L, hq, D).transpose(1, 2)
        kb = k.view(B, L, hkv, D).transpose(1, 2)
        qb, kb = self.apply_rotary_pos_emb(qb, kb, cos, sin)
        return qb.transpose(1, 2).reshape(B * L, hq, D), kb.transpose(1, 2).reshape(B * L, hkv, D)

    def attend(self, attn, q, k, v) -> torch.Tensor:
        ctx = self.ctx
        if ctx is not None:
            k_cache, v_cache = ctx.kv_caches[attn.layer_idx]
            default_cache_write(k, v, k_cache, v_cache, ctx.slot_mapping)
            if _fresh_prefill(ctx):  # no cached prefix: the new K/V are the whole keys, packed
                return packed_causal_attention(q, k, v, ctx.cu_seqlens_q_host, ctx.cu_seqlens_q, ctx.max_seqlen_q,
                                               attn.scaling)
            return default_paged_attention(q, k_cache, v_cache, ctx, attn.scaling)
        if self.cu_host is not None:
            return packed_causal_attention(q, k, v, self.cu_host, self.cu_seqlens, self.max_seqlen, attn.scaling)
        B, L, hq, hkv, D = self.batch, self.length, q.shape[1], k.shape[1], q.shape[2]
        out = sdpa_causal(q.view(B, L, hq, D), k.view(B, L, hkv, D), v.view(B, L, hkv, D), attn.scaling)
        return out.reshape(B * L, hq, D)


def _fresh_prefill(ctx: AttentionContext) -> bool:
    """An engine step whose every sequence attends only to its own new tokens (prompt
    prefill without a cached prefix), known from the host lengths of an eager step."""
    cu, sk = ctx.cu_seqlens_q_host, ctx.seqlens_k_host
    return (ctx.max_seqlen_q > 1 and cu is not None and sk is not None
            and all(lk == b - a for a, b, lk in zip(cu[:-1], cu[1:], sk)))


def default_cache_write(k, v, k_cache, v_cache, slot_mapping):
    """Plain-torch K/V store (default kernels). Slots -1 go to the spare last slot of the
    cache, which the engine never hands out (graph-safe: no data-dependent shapes)."""
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    slots = torch.where(slot_mapping < 0, torch.full_like(slot_mapping, n_slots - 1), slot_mapping).long()
    k_cache.view(n_slots, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(n_slots, *v_cache.shape[2:]).index_copy_(0, slots, v)


def default_paged_attention(q, k_cache, v_cache, ctx: AttentionContext, scale) -> torch.Tensor:
    """SDPA over K/V gathered from the paged cache (default kernels).

    Pure decode (``max_seqlen_q == 1``) runs batched with a length mask (graph-safe);
    anything else loops over sequences with host lengths (eager only).
    """
    P = k_cache.shape[1]
    hq, D = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    bt = ctx.block_table.long()
    Bq = bt.shape[0]
    if ctx.max_seqlen_q == 1 and q.shape[0] == ctx.seqlens_k.shape[0]:
        kg = k_cache[bt].reshape(Bq, -1, hkv, D)          # [B, W*P, Hkv, D]
        vg = v_cache[bt].reshape(Bq, -1, hkv, D)
        j = torch.arange(kg.shape[1], device=q.device)
        mask = (j[None, :] < ctx.seqlens_k[:, None].long())[:, None, None, :]   # [B, 1, 1, S]
        o = F.scaled_dot_product_attention(q[:, None].transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2),
                                           attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
        return o.transpose(1, 2).reshape(q.shape[0], hq, D)
    cu, sk = ctx.cu_seqlens_q_host, ctx.seqlens_k_host
    if cu is None or sk is None:
        raise RuntimeError("default paged attention needs host lengths outside pure decode")
    out = torch.empty_like(q)
    for i in range(len(sk)):
        a, b, lk = cu[i], cu[i + 1], sk[i]
        n = b - a
        if n == 0:
            continue
        pages = bt[i, : (lk + P - 1) // P]
        kk = k_cache[pages].reshape(-1, hkv, D)[:lk]
        vv = v_cache[pages].reshape(-1, hkv, D)[:lk]
        qpos = torch.arange(lk - n, lk, device=q.device)
        mask = torch.arange(lk, device=q.device)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], kk.transpose(0, 1)[None],
                                           vv.transpose(0, 1)[None], attn_mask=mask[None, None], scale=scale,
                                           enable_gqa=hq != hkv)
        out[a:b] = o[0].transpose(0, 1)
    return out
