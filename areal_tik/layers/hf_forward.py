"""The patched HF model's calling convention around the decoder graph (``decoder.py``).

``patch_model`` binds :func:`base_model_forward` on the HF base model (``model.model``), so HF's
``*ForCausalLM.forward``, AReaL's critic head and our engine call it with HF's arguments:

- training: one packed row (``cu_seq_lens_q`` kwargs as AReaL passes them, or ``position_ids``
  that restart at 0 per sequence) or a plain ``[B, L]`` batch; no padding masks;
- engine: an attention context is set (``attn_context``) and ``position_ids`` gives each
  token's absolute position.

It flattens the tokens to ``[B*L]``, builds the step of the model's kernels (``steps.py``:
:func:`tik_step` or :func:`default_step`, bound at patch time), runs the graph and gives back
``[B, L, H]``. Flattening changes no bits: every op computes rows independently.
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from areal_tik.layers.attn_context import AttentionContext, get_context
from areal_tik.layers.decoder import decoder_forward, embed
from areal_tik.layers.family import family_of
from areal_tik.layers.steps import DefaultStep, TikStep

__all__ = ["base_model_forward", "tik_step", "default_step", "Packing"]


@dataclasses.dataclass
class Packing:
    """The sequences of a training forward over ``B*L`` tokens: ``cu_host`` (host list ``[S+1]``) and its
    int32 device copy, and the longest sequence."""

    cu_host: list
    cu_seqlens: torch.Tensor
    max_seqlen: int


def tik_step(self, h: torch.Tensor, position_ids: torch.Tensor, ctx: AttentionContext | None,
             packing: Packing | None) -> TikStep:
    """tik: the fp32 RoPE table of ``h``'s device and the bound ops' attention."""
    cos, sin = self._tik_rope.get(h.device)
    step = TikStep(self._tik_ops, cos, sin, position_ids.reshape(-1).long(), ctx)
    if packing is not None:
        step.cu_seqlens, step.max_seqlen = packing.cu_seqlens, packing.max_seqlen
    return step


def default_step(self, h: torch.Tensor, position_ids: torch.Tensor, ctx: AttentionContext | None,
                 packing: Packing | None) -> DefaultStep:
    """default: HF's rotary embedding in the model dtype; a plain ``[B, L]`` batch runs one batched SDPA."""
    B, L = position_ids.shape
    step = DefaultStep(B, L, self.rotary_emb(h, position_ids),
                       sys.modules[self._tik_hf_module].apply_rotary_pos_emb, ctx)
    if packing is not None and packing.cu_host != list(range(0, B * L + 1, L)):
        step.cu_host, step.cu_seqlens, step.max_seqlen = packing.cu_host, packing.cu_seqlens, packing.max_seqlen
    return step


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


def _packing(B: int, L: int, position_ids: torch.Tensor, kwargs: dict, device: torch.device) -> Packing:
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
    return Packing(cu_host, torch.tensor(cu_host, dtype=torch.int32, device=device),
                   max(b - a for a, b in zip(cu_host[:-1], cu_host[1:])))


def base_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, use_cache=None, cache_position=None, **kwargs):
    """The patched decoder stack (HF's base-model signature). Training: one packed row (``cu_seq_lens_q``
    kwargs or position_ids that restart at 0) or a plain ``[B, L]`` batch. Engine: a context is set and
    ``position_ids`` gives each token's absolute position."""
    # lazy: transformers is imported only by forwards of HF models, never by importing the layers
    from transformers.modeling_outputs import BaseModelOutputWithPast, MoeModelOutputWithPast

    if past_key_values is not None:
        raise ValueError("patched models keep no HF KV cache (past_key_values); use areal_tik.engine for generation")
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    _check_attention_mask(attention_mask)
    B, L = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
    h = embed(self, input_ids, inputs_embeds)
    ctx = get_context()
    if position_ids is None:
        if ctx is not None:
            raise ValueError("engine forward needs position_ids")
        position_ids = torch.arange(L, device=h.device)[None].expand(B, L)
    position_ids = position_ids.reshape(B, L) if position_ids.dim() == 2 else position_ids.view(B, L)
    packing = None if ctx is not None else _packing(B, L, position_ids, kwargs, h.device)
    h = decoder_forward(self, h, self._tik_step(h, position_ids, ctx, packing))
    # an MoE family's HF head reads ``router_logits`` (None: the router's auxiliary loss is refused at patch time)
    out_cls = MoeModelOutputWithPast if family_of(self.config).moe else BaseModelOutputWithPast
    return out_cls(last_hidden_state=h.reshape(B, L, h.shape[-1]))
