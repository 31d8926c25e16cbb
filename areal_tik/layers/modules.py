"""nn.Modules (and forwards) that ``patch_model`` installs, keeping HF attribute names.

Every class here is installed by ``__class__`` swap on an existing HF module, so
parameters, their names, tying and the module tree stay exactly as HF built them
(state dicts, FSDP2 wrapping by ``_no_split_modules`` class name, optimizers unchanged):

- ``TikLinear`` (``nn.Linear``): the bound ``linear`` -- one GEMM schedule for every M.
- ``TikRMSNorm``: the bound ``rms_norm`` with HF's ``weight`` / ``variance_epsilon``.
- ``TikMLP``: ``down_proj(silu_mul(gate_proj(x), up_proj(x)))``.
- ``PagedAttention``: q/k/v/o projections (and Qwen3's ``q_norm``/``k_norm``) as HF
  names them; RoPE and attention through the tik ops (:class:`TikAttention`) or through
  HF's own math (:class:`DefaultAttention`: HF RoPE in the model dtype, SDPA). Both read
  the engine context (``attn_context``) when one is set and then write/read the paged KV
  cache; otherwise they run the training path over packed sequences.

The tik modules call ``self._tik_ops``, the model's :class:`~areal_tik.dispatch.bound.BoundOps`
bound by ``patch_model``: implementations are chosen once, when the model is patched.

Decoder layers and the base model keep their HF classes; ``patch.py`` binds
``decoder_layer_forward`` / ``base_model_forward`` on the instances, so the whole
forward (both regimes) is the one module graph defined here: embedding, per layer
``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (bf16 residual adds), final norm.
"""
from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn.functional as F
from torch import nn

from areal_tik.layers.attn_context import AttentionContext, get_context
from areal_tik.layers.default_varlen import packed_causal_attention, sdpa_causal
from areal_tik.layers.stacking import stacked_output, stacked_projection

__all__ = ["TikLinear", "TikRMSNorm", "TikMLP", "PagedAttention", "TikAttention", "DefaultAttention", "ForwardMeta",
           "RopeCache", "decoder_layer_forward", "base_model_forward", "tik_rope_inputs", "default_rope_inputs"]


class TikLinear(nn.Linear):
    """``nn.Linear`` computed by the bound ``linear`` (batch-invariant rows, fp32 accumulate)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._tik_ops.linear(x, self.weight, self.bias)


class TikRMSNorm(nn.Module):
    """HF RMSNorm (``weight``, ``variance_epsilon``) computed by ``ops.rms_norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._tik_ops.rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, tik"


class TikMLP(nn.Module):
    """HF gated MLP (``gate_proj``/``up_proj``/``down_proj``) with ``ops.silu_mul``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = stacked_output(self, "_tik_gate_up", x)      # stacking.py: same bits, one GEMM
        if gu is not None:
            return self.down_proj(self._tik_ops.silu_mul_packed(gu))
        return self.down_proj(self._tik_ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class RopeCache:
    """The fp32 RoPE table, built once per device by ``ops.rope_table`` (never a buffer
    or parameter, so ``.to(dtype)`` and FSDP mixed precision cannot cast it)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, rope_table):
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self._rope_table = rope_table
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        t = self._tables.get(device)
        if t is None:
            t = self._rope_table(self.head_dim, self.max_positions, self.theta, device, scaling=self.scaling)
            self._tables[device] = t
        return t


@dataclasses.dataclass
class ForwardMeta:
    """What every attention layer of one forward needs (built once per forward)."""

    batch: int
    length: int
    positions: torch.Tensor                       # int64 [B*L]
    ctx: AttentionContext | None                   # engine step, or None (training)
    cu_seqlens: torch.Tensor | None = None         # training: int32 [S+1] over the B*L tokens
    max_seqlen: int = 0
    cu_host: list | None = None                    # training: host copy (default kernels)
    cos: torch.Tensor | None = None                # tik: fp32 table [max_pos, D]
    sin: torch.Tensor | None = None
    position_embeddings: tuple | None = None       # default: HF (cos, sin) [B, L, D] in model dtype


class PagedAttention(nn.Module):
    """Causal GQA self-attention over packed sequences or the engine's paged KV cache.

    Attributes set by ``patch_model``: ``_tik_heads``, ``_tik_kv_heads``, ``head_dim``,
    ``scaling``, ``layer_idx`` (and ``_tik_ops`` on :class:`TikAttention`, ``_tik_hf_module`` on
    :class:`DefaultAttention`); children as HF names them. The subclass, chosen when the model is
    patched, decides RoPE and attention (``_attend``).
    """

    def forward(self, hidden_states: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        B, L = hidden_states.shape[:2]
        T = B * L
        hq, hkv, D = self._tik_heads, self._tik_kv_heads, self.head_dim
        qkv = stacked_projection(self, "_tik_qkv", hidden_states)     # stacking.py: same bits, one GEMM
        if qkv is None:
            qkv = [self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)]
        q, k, v = qkv[0].reshape(T, hq, D), qkv[1].reshape(T, hkv, D), qkv[2].reshape(T, hkv, D)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q.contiguous())
            k = self.k_norm(k.contiguous())
        out = self._attend(q, k, v, meta)
        return self.o_proj(out.reshape(B, L, hq * D))


class TikAttention(PagedAttention):
    """RoPE and attention on the bound tik ops (``kernels="tik"``)."""

    def _attend(self, q, k, v, meta: ForwardMeta) -> torch.Tensor:
        ops = self._tik_ops
        q = ops.apply_rope(q, meta.cos, meta.sin, meta.positions)
        k = ops.apply_rope(k, meta.cos, meta.sin, meta.positions)
        ctx = meta.ctx
        if ctx is not None:
            k_cache, v_cache = ctx.kv_caches[self.layer_idx]
            ops.kv_cache_write(k, v, k_cache, v_cache, ctx.slot_mapping)
            return ops.attention_paged(q, k_cache, v_cache, ctx.block_table, ctx.cu_seqlens_q, ctx.seqlens_k,
                                       ctx.max_seqlen_q, scale=self.scaling)
        # v may be a row-strided view of a stacked q/k/v GEMM output (stacking.py)
        return ops.attention_varlen(q, k, v.contiguous(), meta.cu_seqlens, meta.max_seqlen, scale=self.scaling)


class DefaultAttention(PagedAttention):
    """HF's own RoPE (model dtype) and SDPA, made packed-varlen and paged-cache aware
    (``kernels="default"``, the baseline)."""

    def _attend(self, q, k, v, meta: ForwardMeta) -> torch.Tensor:
        B, L = meta.batch, meta.length
        hq, hkv, D = q.shape[1], k.shape[1], q.shape[2]
        rope = sys.modules[self._tik_hf_module].apply_rotary_pos_emb
        cos, sin = meta.position_embeddings
        qb = q.view(B, L, hq, D).transpose(1, 2)
        kb = k.view(B, L, hkv, D).transpose(1, 2)
        qb, kb = rope(qb, kb, cos, sin)
        q = qb.transpose(1, 2).reshape(B * L, hq, D)
        k = kb.transpose(1, 2).reshape(B * L, hkv, D)
        ctx = meta.ctx
        if ctx is not None:
            k_cache, v_cache = ctx.kv_caches[self.layer_idx]
            default_cache_write(k, v, k_cache, v_cache, ctx.slot_mapping)
            if _fresh_prefill(ctx):  # no cached prefix: the new K/V are the whole keys, packed
                return packed_causal_attention(q, k, v, ctx.cu_seqlens_q_host, ctx.cu_seqlens_q, ctx.max_seqlen_q,
                                               self.scaling)
            return default_paged_attention(q, k_cache, v_cache, ctx, self.scaling)
        if meta.cu_host is not None:
            return packed_causal_attention(q, k, v, meta.cu_host, meta.cu_seqlens, meta.max_seqlen, self.scaling)
        out = sdpa_causal(q.view(B, L, hq, D), k.view(B, L, hkv, D), v.view(B, L, hkv, D), self.scaling)
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


# ---- forwards bound on HF decoder-layer and base-model instances ----------------------------

def tik_rope_inputs(self, meta: ForwardMeta, h: torch.Tensor, position_ids: torch.Tensor) -> None:
    """tik: the fp32 RoPE table of ``h``'s device (applied per layer by the bound ``apply_rope``)."""
    meta.cos, meta.sin = self._tik_rope.get(h.device)


def default_rope_inputs(self, meta: ForwardMeta, h: torch.Tensor, position_ids: torch.Tensor) -> None:
    """default: HF's rotary embedding in the model dtype; a plain ``[B, L]`` batch runs one batched SDPA."""
    if meta.cu_host == list(range(0, meta.batch * meta.length + 1, meta.length)):
        meta.cu_host = None
    meta.position_embeddings = self.rotary_emb(h, position_ids)


def decoder_layer_forward(self, hidden_states: torch.Tensor, meta: ForwardMeta, *args, **kwargs) -> torch.Tensor:
    residual = hidden_states
    h = self.input_layernorm(hidden_states)
    h = self.self_attn(h, meta)
    h = residual + h
    residual = h
    h = self.post_attention_layernorm(h)
    h = self.mlp(h)
    return residual + h


def _segments_from_positions(position_ids: torch.Tensor) -> list[int] | None:
    """cu_seqlens of one packed row whose positions restart at 0 per sequence, or None."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten().tolist()
    if not starts or starts == [0]:
        return None
    if starts[0] != 0:
        raise ValueError("packed position_ids must start at 0")
    return starts + [pos.numel()]


def _check_attention_mask(attention_mask) -> None:
    if attention_mask is None or isinstance(attention_mask, dict):
        return  # AReaL passes {"full_attention": None, ...} with packed inputs
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        if bool((attention_mask == 0).any()):
            raise ValueError("patched models do not take padded batches (attention_mask with zeros): pack the "
                             "sequences into one row with cu_seq_lens_q/position_ids, or use equal lengths")
        return
    raise ValueError(f"patched models take attention_mask None, a dict of None, or a 2-D all-ones mask; got "
                     f"{type(attention_mask).__name__} {getattr(attention_mask, 'shape', '')}")


def base_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, use_cache=None, cache_position=None, **kwargs):
    """The patched decoder stack. Training: one packed row (``cu_seq_lens_q`` kwargs or
    position_ids that restart at 0) or a plain ``[B, L]`` batch. Engine: a context is set
    and ``position_ids`` gives each token's absolute position."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    if past_key_values is not None:
        raise ValueError("patched models keep no HF KV cache (past_key_values); use areal_tik.engine for generation")
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    _check_attention_mask(attention_mask)
    h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    B, L = h.shape[:2]
    ctx = get_context()
    if position_ids is None:
        if ctx is not None:
            raise ValueError("engine forward needs position_ids")
        position_ids = torch.arange(L, device=h.device)[None].expand(B, L)
    position_ids = position_ids.reshape(B, L) if position_ids.dim() == 2 else position_ids.view(B, L)
    meta = ForwardMeta(batch=B, length=L, positions=position_ids.reshape(-1).long(), ctx=ctx)
    if ctx is None:
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None:
            cu = kwargs.get("cu_seqlens")
        if cu is not None:
            if B != 1:
                raise ValueError(f"cu_seq_lens_q needs one packed row, got batch {B}")
            cu_host = [int(x) for x in cu.tolist()]
        elif B == 1 and (cu_host := _segments_from_positions(position_ids)) is not None:
            pass
        else:
            cu_host = list(range(0, B * L + 1, L))
        if cu_host[-1] != B * L:
            raise ValueError(f"cu_seqlens end at {cu_host[-1]} but the batch has {B * L} tokens")
        meta.cu_host = cu_host
        meta.cu_seqlens = torch.tensor(cu_host, dtype=torch.int32, device=h.device)
        meta.max_seqlen = max(b - a for a, b in zip(cu_host[:-1], cu_host[1:]))
    self._tik_rope_inputs(meta, h, position_ids)
    for layer in self.layers[: self.config.num_hidden_layers]:
        h = layer(h, meta)
    h = self.norm(h)
    return BaseModelOutputWithPast(last_hidden_state=h)
