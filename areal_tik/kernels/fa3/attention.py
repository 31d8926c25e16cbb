"""The attention pair on FlashAttention-3 as vLLM 0.24 bundles it (``vllm.vllm_flash_attn``), one walk over the
keys per query tile (``num_splits=1``): the ``fa3`` backend of ``attention_varlen`` and ``attention_paged``.

Entry points (``OPS``), the signatures of the other backends (docs/interfaces.md):

- ``attention_varlen(q, k, v, cu_seqlens, max_seqlen, scale=None)``: R1 (training forward, recompute), autograd;
- ``attention_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q, scale=None)``:
  R2 prefill, R3 chunked prefill, R4 decode over the paged cache ``[num_pages, page_size, Hkv, D]``.

Contract (within this backend): with ``num_splits=1`` FA3 computes each query row in one program that walks its
keys block by block and never splits them across programs, so nothing merges partial softmaxes and a row's
reduction order depends on its position and the kernel's tiles alone; the tiles depend on the head dim, the
dtype and causality, not on the batch, the packing, the page placement or the chunking. Hence, at the shapes
accepted below, a row's bits are the same for every entry point, batch mix, page size and chunking (at head dim 64
FA3's decode launch breaks this: next paragraph); the H200 measurement (docs/results.md): one
sequence's row equal across its whole prefill, one decode query over shuffled pages of 64 and a chunk over the
cached prefix, at the 1.5B shape; the GPU tests check every row, several page sizes and batch mixes. FA3 with its
own split heuristic (``num_splits=0``) breaks this (measured), so the split count is pinned here and recorded in
the fingerprint (``META``) with vLLM's version. Shapes and dtypes: bf16, head dim 128, Hq a multiple of Hkv,
causal, pages of 16, 32 or 64 positions; sm_90 (H100/H200) only (FA3's own requirement).

Both limits are measured (``bench/probes/probe_fa3_invariance.py``, H200, vLLM 0.24.0; docs/results.md): at head dim
64 FA3's decode launch (one query per sequence) computes rows whose bits differ from the same rows of a prefill,
packed or paged, so the engine's log-probs would not equal the trainer's (a tiny model's R2-R5 parity: ~680 of ~690
tokens differ); at head dim 128 every row is equal across the three. With pages of 128 or more positions the paged
launch reads positions past a sequence's ``seqlens_k`` in its last page into the output (NaN in an unused cache slot
reaches the row; zeros leave it bitwise equal), which breaks the pair's "reads only the sequence's own keys"
contract; pages of 16-64 never do. Both are refused with one line naming the limit.

Against the default csrc pair on an H200 (12/2 heads, D 128, pages of 64; docs/results.md): the packed forward
1.33-1.39x faster, decode at batch 64 and contexts 1K-5K 1.02-1.16x faster, at batch 128-256 and short contexts
0.94-0.98x, at batch 1-8 1.7-4.0x slower (one program walks a sequence's keys); hence selectable, not the default.

Backward of ``attention_varlen``: FA3's forward returns each row's natural-log log-sum-exp ``[Hq, T]``; it is
converted to the base-2 ``[T, Hq]`` that the shared backward takes (:mod:`..attention.flash_backward`: PyTorch's
flash-attention-2 backward by default), as the other forwards' autograd does: correct, not bitwise invariant.
Accuracy: relative Frobenius error vs ``attention_reference`` (float64) < 1e-2 (GPU test).
"""
from __future__ import annotations

from importlib import metadata
import math

import torch

from areal_tik.kernels.attention.checks import check_paged, check_varlen, check_window, softmax_scales
from areal_tik.kernels.attention.flash_backward import varlen_attention_backward

__all__ = ["attention_varlen_fa3", "attention_paged_fa3", "flash_fn", "OPS", "META", "NUM_SPLITS", "FA_VERSION",
           "HEAD_DIMS", "PAGE_SIZES", "check_shapes", "CHECK_SHAPES"]

NUM_SPLITS = 1      # one walk over the keys per query tile: the batch-invariant setting
FA_VERSION = 3
HEAD_DIMS = (128,)           # head dims whose rows are equal across prefill, decode and chunks (measured)
PAGE_SIZES = (16, 32, 64)    # page sizes whose launch reads nothing past a sequence's keys (measured)
_LN2 = math.log(2.0)


def _vllm_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


# Bit-defining settings, hashed into the fingerprint: the split count, FA's version, and the vLLM build that ships
# the kernel binary (another vLLM may ship another FA3).
META = {"fa3_num_splits": NUM_SPLITS, "fa_version": FA_VERSION, "vllm": _vllm_version()}


def flash_fn():
    """vLLM's ``flash_attn_varlen_func`` (imported on first use: importing vLLM takes seconds)."""
    # optional dependency (vllm): imported only on this path
    from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func
    return flash_attn_varlen_func


def check_shapes(head_dim: int, page_size: int | None = None, name: str = "attention") -> None:
    """Raise ``ValueError`` (one line naming the limit) unless the pair keeps its contract at this head dim and page
    size (``HEAD_DIMS``, ``PAGE_SIZES``; module docstring). ``patch_model`` and the engine run it up front
    through ``BoundOps.check_shapes``; the entry points run it per call."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{name} (fa3): head dim {head_dim} is not supported: FA3's rows are batch-invariant "
                         f"only at head dim {', '.join(map(str, HEAD_DIMS))}; use the default attention backend")
    if page_size is not None and page_size not in PAGE_SIZES:
        raise ValueError(f"{name} (fa3): page size {page_size} is not supported: FA3 reads past a sequence's keys "
                         f"in pages of 128 or more; use pages of {', '.join(map(str, PAGE_SIZES))}")


def _varlen_fwd(q, k, v, cu_seqlens, max_seqlen, scale, out=None, want_lse=False):
    res = flash_fn()(q, k, v, max_seqlen_q=max_seqlen, cu_seqlens_q=cu_seqlens, max_seqlen_k=max_seqlen,
                     cu_seqlens_k=cu_seqlens, softmax_scale=scale, causal=True, return_softmax_lse=want_lse,
                     out=out, num_splits=NUM_SPLITS, fa_version=FA_VERSION)
    return res if want_lse else (res, None)


class _VarlenFa3Function(torch.autograd.Function):
    """Autograd for the FA3 varlen forward: the backward runs the shared flash-attention-2 backward on the
    forward's output and log-sum-exp (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale):
        out, lse = _varlen_fwd(q, k, v, cu_seqlens, max_seqlen, scale, want_lse=True)
        lse2 = (lse.float() / _LN2).t().contiguous()   # natural log [Hq, T] -> base 2 [T, Hq]
        ctx.save_for_backward(q, k, v, cu_seqlens, out, lse2)
        ctx.scale, ctx.max_seqlen = scale, max_seqlen
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, cu, out, lse2 = ctx.saved_tensors
        _, qk_scale = softmax_scales(ctx.scale, q.shape[-1])
        dq, dk, dv = varlen_attention_backward(q, k, v, out, lse2, cu, ctx.max_seqlen, ctx.scale, qk_scale, dout)
        return dq, dk, dv, None, None, None


def attention_varlen_fa3(q, k, v, cu_seqlens, max_seqlen, scale=None, window_size=None, out=None):
    """R1 packed causal GQA attention on FA3 (one walk). q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` bf16,
    ``cu_seqlens`` int32 ``[B+1]``, ``max_seqlen`` host int >= the longest segment. Returns ``[T, Hq, D]`` bf16,
    bitwise equal to :func:`attention_paged_fa3` for the same positions. ``out``: optional buffer (no autograd)."""
    check_window(window_size)
    check_varlen(q, k, v, cu_seqlens, max_seqlen, triton_path=False)
    check_shapes(q.shape[-1], name="attention_varlen")
    sc, _ = softmax_scales(scale, q.shape[-1])
    m = int(max_seqlen)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _VarlenFa3Function.apply(q, k, v, cu_seqlens, m, sc)
    return _varlen_fwd(q, k, v, cu_seqlens, m, sc, out=out)[0]


def attention_paged_fa3(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q, scale=None,
                        window_size=None, out=None):
    """R2 prefill / R3 chunked prefill / R4 decode over the paged KV cache on FA3 (one walk).

    q ``[Tq, Hq, D]`` bf16; caches ``[num_pages, page_size, Hkv, D]`` bf16; ``block_table`` int32
    ``[B, max_pages]``; ``cu_seqlens_q`` int32 ``[B+1]``; ``seqlens_k`` int32 ``[B]`` (each sequence's keys,
    its queries' own included: the queries are its last positions); ``max_seqlen_q`` host int. No host sync:
    the key bound FA3 sizes its launch by is the table's width in positions, so the call can be graph-captured.
    ``out``: optional ``[Tq, Hq, D]`` buffer to write."""
    check_window(window_size)
    check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q, triton_path=False)
    check_shapes(q.shape[-1], k_cache.shape[1], name="attention_paged")
    sc, _ = softmax_scales(scale, q.shape[-1])
    return flash_fn()(q, k_cache, v_cache, max_seqlen_q=int(max_seqlen_q), cu_seqlens_q=cu_seqlens_q,
                      max_seqlen_k=block_table.shape[1] * k_cache.shape[1], seqused_k=seqlens_k,
                      block_table=block_table, softmax_scale=sc, causal=True, out=out, num_splits=NUM_SPLITS,
                      fa_version=FA_VERSION)


OPS = {
    "attention_varlen": {"fa3": attention_varlen_fa3},
    "attention_paged": {"fa3": attention_paged_fa3},
}
CHECK_SHAPES = check_shapes      # the registry's up-front shape check for both ops (BoundOps.check_shapes)
