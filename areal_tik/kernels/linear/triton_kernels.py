"""The Triton kernels of the linear op: one ``[BLOCK_M, BLOCK_N]`` output tile reduced as
``acc = tl.dot(x_tile, w_tile^T, acc)`` over K in ascending ``BLOCK_K`` steps from a zero fp32
accumulator, with tiles fetched by plain pointer loads, TMA descriptors, or a persistent TMA
schedule (the same dot chain per output tile in each; see the package docstring)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _linear_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_UNROLL: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile; K walked ascending in BLOCK_K steps.

    K_UNROLL only issues K_UNROLL tile loads per loop trip (more bytes in flight for
    memory-bound decode); the sequence of ``acc = dot(a, b^T, acc)`` over BLOCK_K chunks
    is the same for every K_UNROLL.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped tile order: GROUP_M row-tiles share each weight tile while it is in L2
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % num_in_group) % group_size)
    pid_n = (pid % num_in_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    K_STEP: tl.constexpr = BLOCK_K * K_UNROLL
    k_main = (K // K_STEP) * K_STEP
    for k in range(0, k_main, K_STEP):
        for u in tl.static_range(K_UNROLL):
            a = tl.load(x_ptrs + (k + u * BLOCK_K), mask=m_mask[:, None], other=0.0)
            b = tl.load(w_ptrs + (k + u * BLOCK_K), mask=n_mask[:, None], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    for k in range(k_main, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        a = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)

    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped (super-tile) order: GROUP_M row-tiles share each weight tile while in L2."""
    num_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_in_group
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((tile_id % num_in_group) % group_size)
    pid_n = (tile_id % num_in_group) // group_size
    return pid_m, pid_n


@triton.jit
def _store_tile(acc, b_ptr, y_ptr, pid_m, pid_n, M, N, stride_ym,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _linear_fwd_tma_kernel(
    x_desc, w_desc, b_ptr, y_ptr,
    M, N, K, stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
):
    """Same reduction as :func:`_linear_fwd_kernel` (``acc = dot(a, b^T, acc)`` over
    ascending BLOCK_K chunks from a zero fp32 accumulator; the K tail and the M/N edges
    zero-filled by the tensor-memory-accelerator descriptors exactly as the pointer
    kernel's masked loads fill them), tiles fetched by TMA. One tile per program."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = x_desc.load([off_m, k * BLOCK_K])
        b = w_desc.load([off_n, k * BLOCK_K])
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    _store_tile(acc, b_ptr, y_ptr, pid_m, pid_n, M, N, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _linear_fwd_tma_persistent_kernel(
    x_desc, w_desc, b_ptr, y_ptr,
    M, N, K, stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    NUM_PROGS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """Persistent form of :func:`_linear_fwd_tma_kernel`: NUM_PROGS programs walk the
    output tiles (grouped order); each tile's reduction is the same fresh-accumulator
    ascending-K dot chain."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=FLATTEN, warp_specialize=WARP_SPEC):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_tiles):
            a = x_desc.load([off_m, k * BLOCK_K])
            b = w_desc.load([off_n, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        _store_tile(acc, b_ptr, y_ptr, pid_m, pid_n, M, N, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N)
