"""Unified causal GQA attention: one numerical path for training, prefill, chunked prefill
and paged decode .

Entry points (``OPS``):

- ``attention_varlen(q, k, v, cu_seqlens, max_seqlen, scale=None)`` — R1 packed training
  forward with autograd. q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, ``cu_seqlens`` int32
  ``[B+1]`` (a trailing padding segment is just another sequence). Backward gives correct
  dq/dk/dv (not bit-invariant).
- ``attention_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k,
  max_seqlen_q, scale=None)`` — R2 prefill / R3 chunked prefill / R4 decode, any mix per
  launch. Caches ``[num_pages, page_size, Hkv, D]`` (contiguous), ``block_table`` int32
  ``[B, max_pages]``, slot = ``page * page_size + offset``. Sequence i has
  ``n_i = cu_seqlens_q[i+1] - cu_seqlens_q[i]`` queries, its *last* n_i positions
  (``seqlens_k[i]`` includes them; their K/V must already be in the cache).

Maths: ``out[t, h] = softmax(scale * q[t,h] . k[j, h // G]  for j <= pos(t)) @ v``, bf16
in/out, fp32 inside, D in {64, 128}, G = Hq / Hkv (tested 1..8), causal, no window.

The contract (docs/design.md): for a query at absolute position p of a sequence, every
entry point returns the same bits whatever the batch mix, packing, padding, page size,
chunking, tile sizes and launch grid. By construction:

1. KV is cut into fixed partitions of ``KV_PARTITION`` tokens at absolute positions
   ``[j*P, (j+1)*P)``, each walked in fixed blocks of ``BLOCK_N`` tokens aligned to 0, in
   ascending order, with one block step (``_block_step``) starting from a fresh state
   ``(m=-inf, l=0, acc=0)`` per partition. Blocks past the query are exact no-ops
   (alpha is selected as exactly 1, p is exactly 0).
2. Partition states are merged in ascending partition order with one merge
   (``_merge_state``) starting from ``(-inf, 0, 0)``, then ``out = A / L`` rounded once to bf16.
   Decode computes partitions in parallel programs (split-KV at fixed absolute positions);
   the last program of a (sequence, head group) to finish (an atomic arrival counter)
   merges them all in ascending order in the same launch; prefill/training merges
   in-program. Same formula (a lone partition is still merged into the empty state).
   Blocks that every row of a tile sees whole skip the causal select (an identity there).
3. Every reduction whose order could depend on the tile layout goes through ``tl.dot``
   with an accumulator (``acc = tl.dot(p, v, acc)``; the softmax denominator is
   ``l = tl.dot(p, ones, l)``), which the H200 measurements showed to be invariant to
   BLOCK_M/BLOCK_N/warps; row maxima are exact. Kernels are compiled with
   ``enable_fp_fusion=False`` so no mul+add pair is contracted differently in different
   kernels.

Accuracy: relative Frobenius error vs ``attention_reference`` (float64) below 1e-2.

The torch_ref implementations keep the same contract on a CPU with their own bits
(two-pass exact-max softmax, fixed-tree sums inside BLOCK_N blocks, ascending across
blocks, deterministic exp from ``_torch_math``); they do not equal the Triton bits.
"""
from __future__ import annotations

from areal_tik.kernels.attention import tuning
from areal_tik.kernels.attention.reference import attention_reference
from areal_tik.kernels.attention.specs import compile_specs
from areal_tik.kernels.attention.torch_ref import attention_paged_torch, attention_varlen_torch
from areal_tik.kernels.attention.triton_backward import varlen_backward
from areal_tik.kernels.attention.triton_ops import (AttentionVarlenFunction, attention_paged_triton,
                                                    attention_varlen_triton)
from areal_tik.kernels.attention.tuning import META, configure, current_config, load_tuned

__all__ = [
    "attention_varlen", "attention_varlen_triton", "attention_varlen_torch",
    "attention_paged", "attention_paged_triton", "attention_paged_torch",
    "attention_reference", "AttentionVarlenFunction", "varlen_backward",
    "META", "OPS", "COMPILE_SPECS", "configure", "current_config", "load_tuned", "tuning",
]

attention_varlen = attention_varlen_triton
attention_paged = attention_paged_triton

OPS = {
    "attention_varlen": {"triton": attention_varlen_triton, "torch_ref": attention_varlen_torch},
    "attention_paged": {"triton": attention_paged_triton, "torch_ref": attention_paged_torch},
}

tuning._refresh_meta()
load_tuned()
COMPILE_SPECS = compile_specs()
