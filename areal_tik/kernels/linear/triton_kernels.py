"""The Triton kernels of the linear op: one ``[BLOCK_M, BLOCK_N]`` output tile reduced as
``acc = tl.dot(x_tile, w_tile^T, acc)`` over K in ascending ``BLOCK_K`` steps from a zero fp32
accumulator, with tiles fetched by plain pointer loads, TMA descriptors, or a persistent TMA
schedule (the same dot chain per output tile in each; see the package docstring)."""
from __future__ import annotations

import triton
import triton.language as tl


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


@triton.jit
def _ptr_tile(pid, x_ptr, w_ptr, M, N, stride_xm, stride_wn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Program ``pid``'s output tile (grouped order) and the pointers of its first BLOCK_K of x and w."""
    pid_m, pid_n = _tile_coords(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    return pid_m, pid_n, offs_m, offs_n, offs_k, offs_m < M, offs_n < N, x_ptrs, w_ptrs


@triton.jit
def _ptr_chain(x_ptrs, w_ptrs, m_mask, n_mask, offs_k, k_lo, k_hi, acc,
               BLOCK_K: tl.constexpr, K_UNROLL: tl.constexpr, PRECISION: tl.constexpr):
    """``acc = dot(x[:, k:k+BLOCK_K], w[:, k:k+BLOCK_K]^T, acc)`` for k = k_lo, k_lo + BLOCK_K, ... < k_hi
    (pointer loads; the last block masked at k_hi). K_UNROLL only issues K_UNROLL tile loads per loop trip
    (more bytes in flight for memory-bound decode); the dot sequence is the same for every K_UNROLL."""
    K_STEP: tl.constexpr = BLOCK_K * K_UNROLL
    k_main = k_lo + ((k_hi - k_lo) // K_STEP) * K_STEP
    for k in range(k_lo, k_main, K_STEP):
        for u in tl.static_range(K_UNROLL):
            a = tl.load(x_ptrs + (k + u * BLOCK_K), mask=m_mask[:, None], other=0.0)
            b = tl.load(w_ptrs + (k + u * BLOCK_K), mask=n_mask[:, None], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    for k in range(k_main, k_hi, BLOCK_K):
        k_mask = (k + offs_k) < k_hi
        a = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return acc


@triton.jit
def ptr_split_sum(x_ptrs, w_ptrs, m_mask, n_mask, offs_k, K, K_CHUNK,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  K_UNROLL: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr):
    """The fixed split of K in one program. SPLITS == 1: the plain ascending chain over all of K. Otherwise
    chunk c = [c*K_CHUNK, min((c+1)*K_CHUNK, K)) is reduced from a fresh fp32 accumulator and the chunk sums
    are added to a total that starts at +0.0, in ascending c (a loop over the chunks, so the inner chain is
    one software-pipelined loop). Rows may be gathered: ``x_ptrs`` is any [BLOCK_M, BLOCK_K] pointer tile (the
    MoE grouped GEMM, ``kernels/moe/grouped_linear.py``, feeds it indexed rows and one expert's weight)."""
    if SPLITS == 1:
        total = _ptr_chain(x_ptrs, w_ptrs, m_mask, n_mask, offs_k, 0, K,
                           tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), BLOCK_K, K_UNROLL, PRECISION)
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c in range(0, SPLITS):
            lo = c * K_CHUNK
            part = _ptr_chain(x_ptrs, w_ptrs, m_mask, n_mask, offs_k, lo, tl.minimum(lo + K_CHUNK, K),
                              tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), BLOCK_K, K_UNROLL, PRECISION)
            total = total + part
    return total


@triton.jit(do_not_specialize=["M"])
def linear_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, K_CHUNK,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_UNROLL: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile; K walked ascending in BLOCK_K steps, in SPLITS fixed
    chunks of K_CHUNK summed in ascending order (:func:`ptr_split_sum`)."""
    pid = tl.program_id(0)
    pid_m, pid_n, offs_m, offs_n, offs_k, m_mask, n_mask, x_ptrs, w_ptrs = _ptr_tile(
        pid, x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    acc = ptr_split_sum(x_ptrs, w_ptrs, m_mask, n_mask, offs_k, K, K_CHUNK,
                         BLOCK_M, BLOCK_N, BLOCK_K, K_UNROLL, PRECISION, SPLITS)
    _store_tile(acc, b_ptr, y_ptr, pid_m, pid_n, M, N, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def linear_fwd_splitk_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, K_CHUNK,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_UNROLL: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
):
    """The same fixed split of K as :func:`linear_fwd_kernel`, one program per (tile, chunk): more
    programs for a decode-sized M. Each writes its chunk's fp32 sum to ``ws[chunk]`` and counts itself
    in with an atomic; the tile's last chunk to arrive adds the chunk sums to +0.0 in ascending order (the
    in-program kernel's adds: the same bits), adds the bias, stores, and resets the counter to 0."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    pid_m, pid_n, offs_m, offs_n, offs_k, m_mask, n_mask, x_ptrs, w_ptrs = _ptr_tile(
        pid, x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    lo = c * K_CHUNK
    part = _ptr_chain(x_ptrs, w_ptrs, m_mask, n_mask, offs_k, lo, tl.minimum(lo + K_CHUNK, K),
                      tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), BLOCK_K, K_UNROLL, PRECISION)
    mn_mask = m_mask[:, None] & n_mask[None, :]
    ws_tile = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    plane = M.to(tl.int64) * N
    tl.store(ws_ptr + c * plane + ws_tile, part, mask=mn_mask)
    tl.debug_barrier()      # every thread's partial stores precede the release below
    arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in range(0, SPLITS):
            total = total + tl.load(ws_ptr + j * plane + ws_tile, mask=mn_mask, other=0.0, cache_modifier=".cg")
        _store_tile(total, b_ptr, y_ptr, pid_m, pid_n, M, N, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N)
        tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")


@triton.jit
def _tma_chain(x_desc, w_desc, off_m, off_n, t_lo, t_hi,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``acc = dot(a, b^T, acc)`` from a zero fp32 accumulator over the BLOCK_K tiles t_lo .. t_hi - 1 of K,
    fetched by TMA (the K tail zero-filled by the descriptor as the pointer kernel's masked loads fill it)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(t_lo, t_hi):
        a = x_desc.load([off_m, k * BLOCK_K])
        b = w_desc.load([off_n, k * BLOCK_K])
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _tma_split_sum(x_desc, w_desc, off_m, off_n, k_tiles, CHUNK_TILES,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, SPLITS: tl.constexpr):
    """:func:`ptr_split_sum` with TMA loads: chunk c = tiles [c*CHUNK_TILES, (c+1)*CHUNK_TILES) of K, each
    from a fresh accumulator, added to a total that starts at +0.0 in ascending c (SPLITS == 1: the plain
    chain)."""
    if SPLITS == 1:
        total = _tma_chain(x_desc, w_desc, off_m, off_n, 0, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c in range(0, SPLITS):
            lo = c * CHUNK_TILES
            total = total + _tma_chain(x_desc, w_desc, off_m, off_n, lo, tl.minimum(lo + CHUNK_TILES, k_tiles),
                                       BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    return total


@triton.jit(do_not_specialize=["M"])
def linear_fwd_tma_kernel(
    x_desc, w_desc, b_ptr, y_ptr,
    M, N, K, K_CHUNK, stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
):
    """Same reduction as :func:`linear_fwd_kernel` (``acc = dot(a, b^T, acc)`` over
    ascending BLOCK_K chunks from a zero fp32 accumulator, in SPLITS fixed chunks of K_CHUNK
    summed in ascending order; the K tail and the M/N edges zero-filled by the
    tensor-memory-accelerator descriptors exactly as the pointer kernel's masked loads fill
    them), tiles fetched by TMA. One tile per program."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = _tma_split_sum(x_desc, w_desc, off_m, off_n, tl.cdiv(K, BLOCK_K), K_CHUNK // BLOCK_K,
                         BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, SPLITS)
    _store_tile(acc, b_ptr, y_ptr, pid_m, pid_n, M, N, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def linear_fwd_tma_persistent_kernel(
    x_desc, w_desc, b_ptr, y_ptr,
    M, N, K, K_CHUNK, stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
    NUM_PROGS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """Persistent form of :func:`linear_fwd_tma_kernel`: NUM_PROGS programs walk the
    output tiles (grouped order); each tile's reduction is the same fresh-accumulator
    ascending-K dot chain (per fixed chunk of K, chunks summed in ascending order)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=FLATTEN, warp_specialize=WARP_SPEC):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = _tma_split_sum(x_desc, w_desc, off_m, off_n, k_tiles, K_CHUNK // BLOCK_K,
                             BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, SPLITS)
        _store_tile(acc, b_ptr, y_ptr, pid_m, pid_n, M, N, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N)
