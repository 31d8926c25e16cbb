"""The bit-defining block sizes of the log-prob walk, its per-row state ``(m, s, t, z_token)``,
the vocab chunking of ``token_logprobs`` and the row-aligned logits buffers the LSE kernel
needs (its ``tl.multiple_of`` promise)."""
from __future__ import annotations

import math

import torch
import triton

V_BLOCK = 2048             # bit-defining vocab block of the log-sum-exp walk
LSE_WARPS = 8              # bit-defining (reduction tree inside a block)
LOGITS_CHUNK_ELEMS = 1 << 26  # at most T*C logits (x dtype) alive in token_logprobs (128 MiB bf16)
_STATE = 4                 # (m, s, t, z_token) per row, fp32


def chunk_cols(T: int, V: int, budget: int | None = None) -> int:
    """Vocab columns per token_logprobs GEMM chunk: a multiple of V_BLOCK, T*C <= budget."""
    budget = LOGITS_CHUNK_ELEMS if budget is None else budget
    c = (budget // max(T, 1)) // V_BLOCK * V_BLOCK
    return max(V_BLOCK, min(c, triton.cdiv(V, V_BLOCK) * V_BLOCK))


def init_state(T, device):
    st = torch.empty((T, _STATE), dtype=torch.float32, device=device)
    st[:, 0] = -math.inf
    st[:, 1:3] = 0.0
    st[:, 3] = math.nan
    return st


ROW_ALIGN = 8      # the kernel's ``tl.multiple_of(row * stride_l, ROW_ALIGN)`` promise (elements)
_BUF_ALIGN = 64    # logits buffers are allocated with row strides padded to this many elements


def lse_alignment_ok(data_ptr: int, stride0: int, n_rows: int) -> bool:
    """True when the LSE kernel's alignment promises hold for a logits view: base pointer
    16-byte aligned and every row offset a multiple of ROW_ALIGN elements (vector loads
    of up to 16 bytes never straddle; with one row the stride is never used)."""
    return data_ptr % 16 == 0 and (n_rows <= 1 or stride0 % ROW_ALIGN == 0)


def is_aligned(t: torch.Tensor) -> bool:
    return lse_alignment_ok(t.data_ptr(), t.stride(0), t.shape[0])


def padded_row_stride(ncols: int) -> int:
    """Row stride (elements) of the logits buffers: ncols rounded up to _BUF_ALIGN."""
    return max(_BUF_ALIGN, -(-ncols // _BUF_ALIGN) * _BUF_ALIGN)


def alloc_logits_buffer(T: int, ncols: int, dtype, device) -> torch.Tensor:
    """``[T, ncols]`` view with an aligned row stride (any ncols, odd vocab sizes included)."""
    return torch.empty((T, padded_row_stride(ncols)), dtype=dtype, device=device)[:, :ncols]
