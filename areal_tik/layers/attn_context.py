"""Per-step attention metadata set by a rollout engine and read by patched attention.

When a context is set (``set_context``), patched attention layers run the paged-cache
path: write this step's K/V at ``slot_mapping`` into the layer's cache and attend over the
cache (``kv_cache_write`` + ``attention_paged``). With no context they run the training
path (packed varlen). The model's forward signature stays ``(input_ids, position_ids)``.

The container lives in the backend (which the engine builds on); ``engine/context.py``
fills it from scheduled sequences.
"""
from __future__ import annotations

import dataclasses

import torch

__all__ = ["AttentionContext", "set_context", "get_context", "reset_context"]


@dataclasses.dataclass
class AttentionContext:
    """Tensors on the model's device.

    - ``slot_mapping`` int64 ``[T]``: cache slot of each query token's K/V (-1: skip).
    - ``block_table`` int32 ``[B, W]``: pages of each sequence (unused entries 0).
    - ``cu_seqlens_q`` int32 ``[B+1]``; ``seqlens_k`` int32 ``[B]`` (includes the queries).
    - ``max_seqlen_q``: host int (1 for pure decode).
    - ``kv_caches``: per layer ``(k_cache, v_cache)``, each ``[num_pages, page_size, Hkv, D]``.
    - ``cu_seqlens_q_host``/``seqlens_k_host``: host copies (eager paths only; None under graphs).
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor
    max_seqlen_q: int
    kv_caches: list
    cu_seqlens_q_host: list | None = None
    seqlens_k_host: list | None = None


_CONTEXT: AttentionContext | None = None


def set_context(ctx: AttentionContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> AttentionContext | None:
    return _CONTEXT


def reset_context() -> None:
    set_context(None)
