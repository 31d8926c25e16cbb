"""vLLM attention backend (registered in the CUSTOM slot) running our paged-attention ops.

Needs vLLM (0.24). The KV cache keeps vLLM's flash layout ``[2, blocks, block_size, kv_heads,
head_dim]``: ``kv_cache[0]``/``kv_cache[1]`` are our ``k_cache``/``v_cache``. The metadata is
vLLM's own tensors (``glue.TikAttentionMetadata``); the K/V store runs in
``do_kv_cache_update`` (``ops.kv_cache_write``) and attention in ``forward``
(``ops.attention_paged``: the prefill kernel for steps with a query longer than one token,
the split-KV decode kernel for pure-decode steps; same bits per query position either way).

CUDA graphs: full graphs for uniform single-token decode batches. The decode launch reads
only device tensors (``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping``)
that vLLM refills in place before every replay; padded requests have no query and
``seq_len`` 0, so they do nothing. Steps with prefill run eagerly (the prefill grid is
sized by the host ``max_query_len``).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from areal_tik.vllm_plugin import glue, process_ops

__all__ = ["TikAttentionBackend", "TikAttentionImpl", "TikAttentionMetadataBuilder"]

_PAGE_SIZES = [16, 32, 64, 128, 256]   # attention_paged: page size a power of two in 16..256


class TikAttentionMetadataBuilder(AttentionMetadataBuilder[glue.TikAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold = None        # any mix of prefill and decode rows in any order

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> glue.TikAttentionMetadata:
        m = common_attn_metadata
        return glue.metadata_from_common(m.num_actual_tokens, m.max_query_len, m.query_start_loc, m.seq_lens,
                                         m.block_table_tensor, m.slot_mapping)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata):
        meta = self.build(0, common_attn_metadata)
        # capture with one key per request (the replay reads the real lengths from this buffer)
        meta.seq_lens.fill_(1)
        return meta


class TikAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16"]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"     # vLLM maps the name back to its enum: the CUSTOM slot we are registered in

    @staticmethod
    def get_impl_cls():
        return TikAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TikAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes():
        return list(_PAGE_SIZES)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size in _PAGE_SIZES

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        if block_size not in _PAGE_SIZES:
            raise ValueError(f"tik attention needs a block size in {_PAGE_SIZES}, got {block_size}")
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        if include_num_layers_dimension:
            raise NotImplementedError("no cross-layer KV layout")
        return (0, 1, 2, 3, 4)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [64, 128]

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


class TikAttentionImpl(AttentionImpl[glue.TikAttentionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto", logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None, **extra) -> None:
        unsupported = [name for name, bad in (("alibi", alibi_slopes is not None),
                                              ("sliding window", sliding_window is not None),
                                              ("logits soft cap", bool(logits_soft_cap)),
                                              ("KV sharing", kv_sharing_target_layer_name is not None),
                                              (f"attention type {attn_type}", attn_type != AttentionType.DECODER),
                                              (f"kv cache dtype {kv_cache_dtype}",
                                               kv_cache_dtype not in ("auto", "bfloat16")),
                                              (f"extra arguments {sorted(extra)}", bool(extra)))
                       if bad]
        if unsupported:
            raise NotImplementedError(f"tik attention does not support: {', '.join(unsupported)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if kv_cache.numel() == 0:       # no cache bound yet (memory profiling)
            return
        glue.write_kv(key, value, kv_cache, slot_mapping, process_ops())

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: glue.TikAttentionMetadata, output: torch.Tensor, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("tik attention has no fused output quantisation")
        if attn_metadata is None:       # profiling run: no cache bound yet
            return output.fill_(0)
        return glue.paged_attention(query, kv_cache, attn_metadata, self.scale, process_ops(), output)
