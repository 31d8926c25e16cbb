"""The routed experts' GEMM without a host sync: every (token, rank) assignment's row through its expert's weight
in one launch whose grid never depends on the routing.

Maths, for every assignment ``a = t*k + r`` with expert ``e = topk_ids.flat[a]`` (``w [E, N, K]``)::

    out[a] = linear(src[a // row_div], w[e])        # row_div = k: src is x [T, K];  row_div = 1: src is [T*k, K]

each row reduced exactly as the linear op reduces a row (``kernels/linear``): the K chunks of
:func:`~areal_tik.kernels.linear.k_split` (K), each by ``acc = tl.dot(x_tile, w_tile^T, acc)`` over ascending
``BLOCK_K = 64`` steps from a fresh fp32 accumulator, the chunk sums added to +0.0 in ascending order, one
rounding to the source's dtype; it is the linear op's own chain (:func:`~areal_tik.kernels.linear.triton_kernels.
ptr_split_sum`), fed rows gathered by index instead of consecutive rows. ``input_precision`` as the linear op:
``ieee`` for fp32, the tensor cores' bf16/fp16 products otherwise.

How it runs: :func:`~areal_tik.kernels.moe.routing.routing_plan` (:mod:`.routing`) sorts the assignments by
expert (stable: within an expert in ascending ``a``) and cuts each expert's run into blocks of ``BLOCK_M`` rows,
writing a block table ``(expert, first position in the sorted order, rows)`` of the static length
:func:`~areal_tik.kernels.moe.routing.max_blocks` ``(T*k, E, BLOCK_M)``; the table's unused entries have 0 rows.
Nothing reads a value back to the host, so the forward can be captured in a CUDA graph.
:func:`grouped_linear` launches ``(max_blocks, cdiv(N, BLOCK_N))`` programs, a grid (and launch
arguments) that depends on ``T*k``, ``E``, ``N`` and ``K`` only; a program whose block has no rows exits at once.
Every assignment row lies in exactly one block, so every row of ``out`` is written once. (An id outside
``[0, E)``, which the router never emits, would get no block: its row left unwritten, no weight read past E.)

Invariance: ``out[a]`` depends only on its source row and ``w[e]``. On the GPU it equals ``linear_fwd`` on that
row alone bit for bit: the linear op's dot chain per output element is the same for every tile shape and row
position (the GPU fact ``kernels/linear`` relies on and its tests measure; ``tests/kernels/
test_moe_grouped_linear.py::test_gpu_grouped_rows_equal_linear_fwd_rows`` checks it for this kernel). Under the
CPU interpreter the bits come from the test setup's dot (``kernels/_interpreter_fix``: bf16/fp32 products
accumulated k by k in fp32, independent of the tile shape), which also makes each row equal ``linear_fwd`` on it.

Shapes/dtypes: src and w of one dtype (bf16, fp16, fp32), unit last stride, w ``[E, N, K]`` contiguous; ids int32
or int64 in ``[0, E)``. The out buffer ``[T*k, N]`` (unit last stride) in src's dtype. The caller checks the
arguments (``moe.checks.validate_experts``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from areal_tik.kernels import interpreting
from areal_tik.kernels.linear.configs import BLOCK_K
from areal_tik.kernels.linear.launcher import dot_precision
from areal_tik.kernels.linear.splits import k_split
from areal_tik.kernels.linear.triton_kernels import ptr_split_sum
from areal_tik.kernels.swiglu import silu_times
from areal_tik.kernels.moe.routing import (CHUNKED_MAX_ASSIGNMENTS, ONE_PROGRAM_MAX_ASSIGNMENTS, RoutingPlan,
                                          block_m_for, plan_implementation)

__all__ = ["grouped_linear_kernel", "grouped_linear_silu_kernel", "grouped_tile", "grouped_linear", "tile_config",
           "GPU_TILES", "FUSED_SILU_MAX_BLOCK_M", "compile_specs", "token_counts_per_tile"]


@triton.jit
def grouped_tile(src_ptr, w_ptr, order_ptr, blocks_ptr, b, pid_n, N, ROW_DIV, stride_src, stride_we, stride_wn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Block b's rows x output columns ``pid_n * BLOCK_N ..``: ``(count, a, m_mask, offs_n, n_mask, offs_k, x_ptrs,
    w_ptrs)``, the assignments ``a`` of the block's rows (through the sorted order), the source rows' and its
    expert's weight rows' first K tile. ``count`` 0: the table entry holds no block (nothing else is meaningful)."""
    count = tl.load(blocks_ptr + b * 3 + 2)
    e = tl.load(blocks_ptr + b * 3).to(tl.int64)
    start = tl.load(blocks_ptr + b * 3 + 1).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    m_mask = rows < count
    a = tl.load(order_ptr + start + rows, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = src_ptr + (a // ROW_DIV)[:, None] * stride_src + offs_k[None, :]
    w_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    return count, a, m_mask, offs_n, n_mask, offs_k, x_ptrs, w_ptrs


@triton.jit
def grouped_linear_kernel(src_ptr, w_ptr, y_ptr, order_ptr, blocks_ptr,
                          N, K, K_CHUNK, ROW_DIV, stride_src, stride_we, stride_wn, stride_y,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          K_UNROLL: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr):
    """One block of one expert's assignment rows x one BLOCK_N slice of its outputs: rows gathered through the
    sorted order, reduced by the linear op's chain (:func:`ptr_split_sum`), stored at their assignments."""
    count, a, m_mask, offs_n, n_mask, offs_k, x_ptrs, w_ptrs = grouped_tile(
        src_ptr, w_ptr, order_ptr, blocks_ptr, tl.program_id(0), tl.program_id(1), N, ROW_DIV, stride_src, stride_we,
        stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    if count > 0:
        acc = ptr_split_sum(x_ptrs, w_ptrs, m_mask, n_mask, offs_k, K, K_CHUNK,
                            BLOCK_M, BLOCK_N, BLOCK_K, K_UNROLL, PRECISION, SPLITS)
        y_ptrs = y_ptr + a[:, None] * stride_y + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def grouped_linear_silu_kernel(src_ptr, w_ptr, h_ptr, order_ptr, blocks_ptr,
                               I, K, K_CHUNK, ROW_DIV, UP_OFF, stride_src, stride_we, stride_wn, stride_h,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               K_UNROLL: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr):
    """:func:`grouped_linear_kernel` on an expert's stacked gate/up weight ``[2I, K]`` with the SiLU-and-multiply
    in its epilogue: the gate columns j and the up columns ``I + j`` (``UP_OFF`` = I weight rows further) of the
    block's rows, each by the linear op's chain and rounded as its store rounds, then
    :func:`~areal_tik.kernels.swiglu.silu_times`, stored as ``h [T*k, I]`` at the rows' assignments: the bits of
    :func:`grouped_linear_kernel` then ``silu_mul_packed``, without the ``[T*k, 2I]`` buffer or its launch."""
    count, a, m_mask, offs_n, n_mask, offs_k, x_ptrs, w_g = grouped_tile(
        src_ptr, w_ptr, order_ptr, blocks_ptr, tl.program_id(0), tl.program_id(1), I, ROW_DIV, stride_src, stride_we,
        stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    if count > 0:
        dt = h_ptr.dtype.element_ty
        g = ptr_split_sum(x_ptrs, w_g, m_mask, n_mask, offs_k, K, K_CHUNK, BLOCK_M, BLOCK_N, BLOCK_K, K_UNROLL,
                          PRECISION, SPLITS).to(dt).to(tl.float32)
        u = ptr_split_sum(x_ptrs, w_g + UP_OFF, m_mask, n_mask, offs_k, K, K_CHUNK, BLOCK_M, BLOCK_N, BLOCK_K,
                          K_UNROLL, PRECISION, SPLITS).to(dt).to(tl.float32)
        h_ptrs = h_ptr + a[:, None] * stride_h + offs_n[None, :]
        tl.store(h_ptrs, silu_times(g, u, h_ptr), mask=m_mask[:, None] & n_mask[None, :])


#: BLOCK_M -> the launch's other tile constants on a GPU (speed only; BLOCK_K is the linear op's). 16 and 128:
#: the fastest tile of ``bench/probes/probe_moe_grouped_tiles.py`` for both GEMMs of the Qwen3-30B-A3B experts on
#: an H200 (decode B 64 and 256; an 8,192-token prefill chunk), bits equal to every other tile's
GPU_TILES = {16: dict(BLOCK_N=128, K_UNROLL=2, num_warps=4, num_stages=3),
             32: dict(BLOCK_N=64, K_UNROLL=1, num_warps=4, num_stages=4),
             64: dict(BLOCK_N=128, K_UNROLL=1, num_warps=4, num_stages=4),
             128: dict(BLOCK_N=256, K_UNROLL=1, num_warps=8, num_stages=3)}
INTERPRETER_TILE = dict(BLOCK_N=32, K_UNROLL=1, num_warps=4, num_stages=1)


def token_counts_per_tile(num_experts: int, top_k: int, min_tokens: int, max_tokens: int) -> list[int]:
    """One token count T in ``[min_tokens, max_tokens]`` per (tile, routing-plan implementation) that some T in
    that range reaches (:func:`block_m_for` of ``T * top_k`` assignments over ``num_experts``, and
    :func:`~areal_tik.kernels.moe.routing.plan_implementation`): what precompilation runs the experts at, so that no
    later step compiles a kernel. Both grow with T, so the T at which the mean rows per expert equal a tile's
    BLOCK_M (the last T of that tile's range, the first of the large tile's), the last T of each implementation's
    range, and the range's ends, reach every pair."""
    ends = [bm * num_experts // top_k for bm in sorted(GPU_TILES)]
    ends += [ONE_PROGRAM_MAX_ASSIGNMENTS // top_k, CHUNKED_MAX_ASSIGNMENTS // top_k]
    counts: dict[tuple[int, str], int] = {}
    for t in (min_tokens, *sorted(ends), max_tokens):
        t = max(min_tokens, min(max_tokens, t))
        n = t * top_k
        counts.setdefault((block_m_for(n, num_experts), plan_implementation(n, True)), t)
    return sorted(set(counts.values()))


def tile_config(block_m: int) -> dict:
    """The launch's tile constants beside BLOCK_M (a fresh dict)."""
    return dict(INTERPRETER_TILE if interpreting() else GPU_TILES[block_m])


def compile_specs() -> list[dict]:
    """Compile-check specs: the bf16 kernel at every GPU tile, one K chunk."""
    sig = {"src_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "order_ptr": "*i64", "blocks_ptr": "*i32",
           "N": "i32", "K": "i32", "K_CHUNK": "i32", "ROW_DIV": "i32", "stride_src": "i32", "stride_we": "i32",
           "stride_wn": "i32", "stride_y": "i32"}
    fused_sig = {**{k: v for k, v in sig.items() if k not in ("y_ptr", "N", "stride_y")}, "h_ptr": "*bf16", "I": "i32",
                 "UP_OFF": "i32", "stride_h": "i32"}
    fused_sig = {n: fused_sig[n] for n in grouped_linear_silu_kernel.arg_names
                 if n in fused_sig}     # the kernel's argument order
    specs = []
    for bm, tile in GPU_TILES.items():
        t = dict(tile)
        nw, ns = t.pop("num_warps"), t.pop("num_stages")
        cx = dict(t, BLOCK_M=bm, BLOCK_K=BLOCK_K, PRECISION="tf32", SPLITS=1)
        specs.append(dict(fn=grouped_linear_kernel, signature=sig, num_warps=nw, num_stages=ns, constexprs=cx))
        if bm <= FUSED_SILU_MAX_BLOCK_M:
            specs.append(dict(fn=grouped_linear_silu_kernel, signature=fused_sig, num_warps=nw, num_stages=ns,
                              constexprs=cx))
    return specs


#: the largest BLOCK_M whose plan runs the gate/up GEMM with its activation fused (``grouped_linear(..., silu=True)``):
#: the tile probe on an H200 (bench/results/2026-12-07T1824_H200_77b9bdd_30b-a3b-h200-rows-tiles-profile, moe_tiles)
#: timed the fused launch at us per layer vs the GEMM + ``silu_mul_packed`` pair 181.9 vs 184.4 (B 64, BLOCK_M 16),
#: 206.8 vs 212.3 (B 256), 1,230 vs 1,322 (8,192 tokens, BLOCK_M 64), bits equal; at BLOCK_M 128 (BLOCK_N 256, 8
#: warps: two accumulators of 128 x 256) it took 4,484 vs 1,107
FUSED_SILU_MAX_BLOCK_M = 64


def grouped_linear(src: torch.Tensor, w: torch.Tensor, plan: RoutingPlan, row_div: int,
                   out: torch.Tensor | None = None, splits: int | None = None,
                   tile: dict | None = None, silu: bool = False) -> torch.Tensor:
    """``out[a] = linear(src[a // row_div], w[expert of a])`` for every assignment a of ``plan`` (module
    docstring); with ``silu``, ``w [E, 2I, K]`` stacks gate then up rows and ``out [T*k, I]`` gets
    ``silu_mul_packed`` of that row in the same launch (:func:`grouped_linear_silu_kernel`: the same bits).
    ``splits`` overrides the number of K chunks (:func:`~areal_tik.kernels.linear.k_split`): tests. ``tile``
    replaces :func:`tile_config`'s constants beside BLOCK_M (speed only): probes."""
    n_rows = plan.order.numel()
    E, N, K = w.shape
    n_out = N // 2 if silu else N
    if out is None:
        out = torch.empty((n_rows, n_out), dtype=src.dtype, device=src.device)
    if n_rows == 0 or n_out == 0:
        return out
    if K == 0:
        return out.zero_()                  # with silu too: silu(0) * 0
    n_chunks, chunk = k_split(K, splits)
    cfg = dict(tile) if tile is not None else tile_config(plan.block_m)
    nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
    grid = (plan.blocks.shape[0], triton.cdiv(n_out, cfg["BLOCK_N"]))
    consts = dict(BLOCK_M=plan.block_m, BLOCK_K=BLOCK_K, PRECISION=dot_precision(src.dtype), SPLITS=n_chunks,
                  num_warps=nw, num_stages=ns, **cfg)
    if silu:
        grouped_linear_silu_kernel[grid](
            src, w, out, plan.order, plan.blocks, n_out, K, chunk, row_div, n_out * w.stride(1), src.stride(0),
            w.stride(0), w.stride(1), out.stride(0), **consts)
    else:
        grouped_linear_kernel[grid](
            src, w, out, plan.order, plan.blocks, N, K, chunk, row_div, src.stride(0), w.stride(0), w.stride(1),
            out.stride(0), **consts)
    return out
    if K == 0:
        return out.zero_()
    n_chunks, chunk = k_split(K, splits)
    cfg = dict(tile) if tile is not None else tile_config(plan.block_m)
    nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
    grid = (plan.blocks.shape[0], triton.cdiv(N, cfg["BLOCK_N"]))
    grouped_linear_kernel[grid](
        src, w, out, plan.order, plan.blocks, N, K, chunk, row_div, src.stride(0), w.stride(0), w.stride(1),
        out.stride(0), BLOCK_M=plan.block_m, BLOCK_K=BLOCK_K, PRECISION=dot_precision(src.dtype), SPLITS=n_chunks,
        num_warps=nw, num_stages=ns, **cfg)
    return out
