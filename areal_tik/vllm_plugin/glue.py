"""From vLLM's attention inputs to our paged-attention ops (pure torch, no vLLM import).

vLLM (0.24) hands a backend, per step and layer:
- query/key/value of the step's flattened tokens, ``[T, H, D]`` (``T`` may be padded up to a
  CUDA-graph size; rows past the real tokens are padding);
- its KV cache for the layer, ``[2, num_blocks, block_size, Hkv, D]``: ``kv_cache[0]`` and
  ``kv_cache[1]`` are exactly our ``k_cache``/``v_cache`` layout (contiguous views);
- ``query_start_loc`` int32 ``[R+1]`` (request r's queries are rows ``[qsl[r], qsl[r+1])``),
  ``seq_lens`` int32 ``[R]`` (tokens of request r including this step's), ``block_table``
  int32 ``[R, max_blocks]`` and ``slot_mapping`` int64 (slot = block * block_size + offset,
  -1 for padding), all of which are our ``attention_paged`` / ``kv_cache_write`` arguments
  one to one: ``cu_seqlens_q = query_start_loc``, ``seqlens_k = seq_lens``; and the host int
  ``max_query_len`` is our ``max_seqlen_q`` (1 for a pure-decode step: the split-KV decode
  kernel). Requests added to pad a CUDA-graph batch have no queries and ``seq_len`` 0.
"""
from __future__ import annotations

import dataclasses

import torch


__all__ = ["TikAttentionMetadata", "metadata_from_common", "split_kv_cache", "write_kv", "paged_attention"]


@dataclasses.dataclass
class TikAttentionMetadata:
    num_actual_tokens: int          # real (unpadded) tokens of the step
    max_query_len: int              # host int: our max_seqlen_q
    query_start_loc: torch.Tensor   # int32 [R+1]: our cu_seqlens_q
    seq_lens: torch.Tensor          # int32 [R]: our seqlens_k
    block_table: torch.Tensor       # int32 [R, max_blocks]
    slot_mapping: torch.Tensor      # int64 [>= num_actual_tokens], -1 = skip


def metadata_from_common(num_actual_tokens: int, max_query_len: int, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, block_table: torch.Tensor,
                         slot_mapping: torch.Tensor) -> TikAttentionMetadata:
    """Our metadata from the fields of vLLM's ``CommonAttentionMetadata`` (no copies: the tensors
    are vLLM's persistent buffers, which CUDA-graph replays read)."""
    if query_start_loc.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_table.dtype != torch.int32:
        raise TypeError(f"expected int32 query_start_loc/seq_lens/block_table, got {query_start_loc.dtype}, "
                        f"{seq_lens.dtype}, {block_table.dtype}")
    return TikAttentionMetadata(num_actual_tokens=int(num_actual_tokens), max_query_len=int(max_query_len),
                                query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                                slot_mapping=slot_mapping)


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2, blocks, block_size, Hkv, D]`` -> (k_cache, v_cache), views ``[blocks, block_size, Hkv, D]``."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"expected a KV cache [2, blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    return kv_cache[0], kv_cache[1]


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             ops) -> None:
    """Store this step's K/V at ``slot_mapping`` (``ops.kv_cache_write``; -1 skipped). Key rows past the
    slot mapping (CUDA-graph padding beyond what vLLM maps) are not stored."""
    k_cache, v_cache = split_kv_cache(kv_cache)
    n = min(key.shape[0], slot_mapping.shape[0])
    ops.kv_cache_write(key[:n], value[:n], k_cache, v_cache, slot_mapping[:n])


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: TikAttentionMetadata, scale: float, ops,
                    output: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.attention_paged`` over vLLM's cache for every query row; the K/V of the step must be
    stored already (:func:`write_kv`). ``output`` (``[T, Hq, D]``, or flat ``[T, Hq*D]``) receives
    the result when given (rows past the requests' queries are padding: unspecified values, never
    read for a real token, since every later op works row by row)."""
    k_cache, v_cache = split_kv_cache(kv_cache)
    out = ops.attention_paged(query, k_cache, v_cache, meta.block_table, meta.query_start_loc, meta.seq_lens,
                              meta.max_query_len, scale=scale)
    if output is None:
        return out
    output.view(out.shape).copy_(out)
    return output
