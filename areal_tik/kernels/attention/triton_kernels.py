"""Triton kernels of the attention forward: one online-softmax block step, the partition merge,
the prefill / chunked-prefill / training kernel (``attn_fwd_kernel``) and the split-KV decode
kernel (``attn_decode_kernel``), which share the step and the merge so every regime rounds alike.
The contract they keep is in the package docstring."""
from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def _block_step(q, k, v, valid, m, l_t, acc, qk_scale, ones, MASKED: tl.constexpr):
    """One BLOCK_N step of the online softmax (log2 domain). k is [D, BN], v is [BN, D].
    MASKED=False is for blocks every row sees whole: the select it skips would be the
    identity there, so both forms give the same bits."""
    s = tl.dot(q, k)
    s = s * qk_scale
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m_new > m, tl.exp2(m - m_safe), 1.0)
    p = tl.exp2(s - m_safe[:, None])
    pb = p.to(tl.bfloat16)
    l_t = tl.dot(pb, ones, l_t * alpha[:, None])
    acc = tl.dot(pb, v, acc * alpha[:, None])
    return m_new, l_t, acc


@triton.jit
def _merge_state(M, L, A, m, l, acc, take, TAKE_ALL: tl.constexpr):
    """Fold one partition's (m, l, acc) into the running (M, L, A) for rows where ``take``
    (TAKE_ALL: every row; the selects it skips would be identities)."""
    m_new = tl.maximum(M, m)
    a = tl.where(m_new > M, tl.exp2(M - m_new), 1.0)
    b = tl.where(m_new > m, tl.exp2(m - m_new), 1.0)
    L2 = L * a + l * b
    A2 = A * a[:, None] + acc * b[:, None]
    if TAKE_ALL:
        return m_new, L2, A2
    else:
        M = tl.where(take, m_new, M)
        L = tl.where(take, L2, L)
        A = tl.where(take[:, None], A2, A)
        return M, L, A


@triton.jit
def _load_kv_block(K, V, BT, seq, hk, kv_row0, offs_n, kv_ok, offs_d,
                   stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
                   PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """K block as [D, BN] and V block as [BN, D]; with MASKED rows past the sequence load as 0."""
    if PAGED:
        if MASKED:
            page = tl.load(BT + seq * stride_bt + offs_n // PAGE_SIZE, mask=kv_ok, other=0)
        else:
            page = tl.load(BT + seq * stride_bt + offs_n // PAGE_SIZE)
        row = page.to(tl.int64) * PAGE_SIZE + (offs_n % PAGE_SIZE)
    else:
        row = (kv_row0 + offs_n).to(tl.int64)
    if MASKED:
        k = tl.load(K + row[None, :] * stride_kt + hk * stride_kh + offs_d[:, None], mask=kv_ok[None, :], other=0.0)
        v = tl.load(V + row[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
    else:
        k = tl.load(K + row[None, :] * stride_kt + hk * stride_kh + offs_d[:, None])
        v = tl.load(V + row[:, None] * stride_vt + hk * stride_vh + offs_d[None, :])
    return k, v


@triton.jit
def _fwd_block(q, K, V, BT, seq, hk, q_start, start_n, seqlen_k, pos, offs_d, m, l_t, acc, qk_scale, ones,
               stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
               BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Load the KV block at ``start_n`` and take its online-softmax step; MASKED: a block some
    row sees only in part (causal diagonal or sequence end)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kv_ok = offs_n < seqlen_k
    k, v = _load_kv_block(K, V, BT, seq, hk, q_start, offs_n, kv_ok, offs_d,
                          stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
                          PAGED, PAGE_SIZE, MASKED)
    if MASKED:
        valid = (offs_n[None, :] <= pos[:, None]) & kv_ok[None, :]
        return _block_step(q, k, v, valid, m, l_t, acc, qk_scale, ones, True)
    else:
        return _block_step(q, k, v, 0, m, l_t, acc, qk_scale, ones, False)


@triton.jit
def attn_fwd_kernel(Q, K, V, O, LSE, BT, CUQ, SEQK, qk_scale,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ot, stride_oh, stride_lt, stride_bt,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, PAGED: tl.constexpr,
                     PAGE_SIZE: tl.constexpr, STORE_LSE: tl.constexpr, FLAT: tl.constexpr):
    """Prefill / chunked prefill / packed varlen: one program = BLOCK_M queries x 1 head.
    Grid (Hq, m-blocks, B); m-blocks run last-first so the longest causal rows start first.
    Blocks every row of the tile sees whole run unmasked; the rest (the diagonal) masked."""
    hq = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tl.program_id(2)
    hk = hq // GROUP
    q_start = tl.load(CUQ + seq)
    n_q = tl.load(CUQ + seq + 1) - q_start
    if pid_m * BLOCK_M < n_q:
        if PAGED:
            seqlen_k = tl.load(SEQK + seq)
        else:
            seqlen_k = n_q
        pos0 = seqlen_k - n_q
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < n_q
        pos = pos0 + offs_m
        offs_d = tl.arange(0, HEAD_DIM)
        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * stride_qt + hq * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        pos_first = pos0 + pid_m * BLOCK_M
        kv_end = pos0 + tl.minimum(n_q, (pid_m + 1) * BLOCK_M)
        n_full = ((pos_first + 1) // BLOCK_N) * BLOCK_N      # blocks below: seen whole by every row
        ones = tl.full([BLOCK_N, 16], 1.0, tl.float32).to(tl.bfloat16)
        M = tl.full([BLOCK_M], float("-inf"), tl.float32)
        L = tl.zeros([BLOCK_M], tl.float32)
        A = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if FLAT:
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_t = tl.zeros([BLOCK_M, 16], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
            for start_n in range(0, n_full, BLOCK_N):
                m, l_t, acc = _fwd_block(q, K, V, BT, seq, hk, q_start, start_n, seqlen_k, pos, offs_d, m, l_t, acc,
                                         qk_scale, ones, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
                                         BLOCK_N, PAGED, PAGE_SIZE, False)
                if (start_n + BLOCK_N) % PARTITION == 0:
                    M, L, A = _merge_state(M, L, A, m, tl.max(l_t, 1), acc, 0, True)
                    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
                    l_t = tl.zeros([BLOCK_M, 16], tl.float32)
                    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
            for start_n in range(n_full, kv_end, BLOCK_N):
                m, l_t, acc = _fwd_block(q, K, V, BT, seq, hk, q_start, start_n, seqlen_k, pos, offs_d, m, l_t, acc,
                                         qk_scale, ones, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
                                         BLOCK_N, PAGED, PAGE_SIZE, True)
                if (start_n + BLOCK_N) % PARTITION == 0:
                    M, L, A = _merge_state(M, L, A, m, tl.max(l_t, 1), acc,
                                           pos >= start_n + BLOCK_N - PARTITION, False)
                    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
                    l_t = tl.zeros([BLOCK_M, 16], tl.float32)
                    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
            end_blk = tl.cdiv(kv_end, BLOCK_N) * BLOCK_N
            if end_blk % PARTITION != 0:
                M, L, A = _merge_state(M, L, A, m, tl.max(l_t, 1), acc,
                                       pos >= (end_blk // PARTITION) * PARTITION, False)
        else:
            for part_start in range(0, kv_end, PARTITION):
                m = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_t = tl.zeros([BLOCK_M, 16], tl.float32)
                acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
                part_end = tl.minimum(part_start + PARTITION, kv_end)
                mid = tl.maximum(tl.minimum(n_full, part_end), part_start)
                for start_n in range(part_start, mid, BLOCK_N):
                    m, l_t, acc = _fwd_block(q, K, V, BT, seq, hk, q_start, start_n, seqlen_k, pos, offs_d, m, l_t,
                                             acc, qk_scale, ones, stride_kt, stride_kh, stride_vt, stride_vh,
                                             stride_bt, BLOCK_N, PAGED, PAGE_SIZE, False)
                for start_n in range(mid, part_end, BLOCK_N):
                    m, l_t, acc = _fwd_block(q, K, V, BT, seq, hk, q_start, start_n, seqlen_k, pos, offs_d, m, l_t,
                                             acc, qk_scale, ones, stride_kt, stride_kh, stride_vt, stride_vh,
                                             stride_bt, BLOCK_N, PAGED, PAGE_SIZE, True)
                M, L, A = _merge_state(M, L, A, m, tl.max(l_t, 1), acc, pos >= part_start, False)
        out = A / L[:, None]
        tl.store(O + q_rows[:, None] * stride_ot + hq * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None])
        if STORE_LSE:
            tl.store(LSE + q_rows * stride_lt + hq, M + tl.log2(L), mask=row_ok)


@triton.jit
def attn_decode_kernel(Q, KC, VC, BT, CUQ, SEQK, O, WM, WL, WA, CNT, qk_scale,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
                        stride_ot, stride_oh, n_parts, n_heads_q, n_hslots,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, PAGE_SIZE: tl.constexpr,
                        HSPLIT: tl.constexpr):
    """Decode split-KV in ONE launch: a program = one sequence x GROUP/HSPLIT query heads of
    one KV head (packed into MMA rows) x one fixed absolute partition. It writes its
    partition state, counts itself in with an atomic; the last of the sequence's partitions
    to arrive merges all of them in ascending order (the prefill merge formula) and writes
    the output, then resets the counter to 0. A single partition merges in registers."""
    part = tl.program_id(0)
    hslot = tl.program_id(1)            # hk * HSPLIT + split index
    seq = tl.program_id(2)
    hk = hslot // HSPLIT
    seqlen_k = tl.load(SEQK + seq)
    n_mine = tl.cdiv(seqlen_k, PARTITION)
    if part < n_mine:
        part_start = part * PARTITION
        q_row = tl.load(CUQ + seq).to(tl.int64)
        pos = seqlen_k - 1
        offs_h = tl.arange(0, BLOCK_H)
        h_ok = offs_h < GROUP // HSPLIT
        hq = hslot * (GROUP // HSPLIT) + offs_h
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + q_row * stride_qt + hq[:, None] * stride_qh + offs_d[None, :],
                    mask=h_ok[:, None], other=0.0)
        ones = tl.full([BLOCK_N, 16], 1.0, tl.float32).to(tl.bfloat16)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_t = tl.zeros([BLOCK_H, 16], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        part_end = tl.minimum(part_start + PARTITION, seqlen_k)
        full_end = part_start + ((part_end - part_start) // BLOCK_N) * BLOCK_N
        for start_n in range(part_start, full_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k, v = _load_kv_block(KC, VC, BT, seq, hk, 0, offs_n, offs_n < seqlen_k, offs_d,
                                  stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
                                  True, PAGE_SIZE, False)
            m, l_t, acc = _block_step(q, k, v, 0, m, l_t, acc, qk_scale, ones, False)
        for start_n in range(full_end, part_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kv_ok = offs_n < seqlen_k
            k, v = _load_kv_block(KC, VC, BT, seq, hk, 0, offs_n, kv_ok, offs_d,
                                  stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
                                  True, PAGE_SIZE, True)
            valid = (offs_n[None, :] <= pos) & kv_ok[None, :] & (offs_h[:, None] >= 0)
            m, l_t, acc = _block_step(q, k, v, valid, m, l_t, acc, qk_scale, ones, True)
        l = tl.max(l_t, 1)
        o_ptr = O + q_row * stride_ot + hq[:, None] * stride_oh + offs_d[None, :]
        M = tl.full([BLOCK_H], float("-inf"), tl.float32)
        L = tl.zeros([BLOCK_H], tl.float32)
        A = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        if n_mine == 1:
            M, L, A = _merge_state(M, L, A, m, l, acc, h_ok, False)
            tl.store(o_ptr, (A / L[:, None]).to(O.dtype.element_ty), mask=h_ok[:, None])
        else:
            base = (seq * n_heads_q + hq).to(tl.int64) * n_parts
            ws = base + part
            tl.store(WM + ws, m, mask=h_ok)
            tl.store(WL + ws, l, mask=h_ok)
            tl.store(WA + ws[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=h_ok[:, None])
            tl.debug_barrier()      # every thread's state stores precede the release below
            cnt = CNT + seq * n_hslots + hslot
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if arrived == n_mine - 1:
                for j in range(0, n_mine):
                    mj = tl.load(WM + base + j, mask=h_ok, other=float("-inf"), cache_modifier=".cg")
                    lj = tl.load(WL + base + j, mask=h_ok, other=0.0, cache_modifier=".cg")
                    aj = tl.load(WA + (base + j)[:, None] * HEAD_DIM + offs_d[None, :], mask=h_ok[:, None],
                                 other=0.0, cache_modifier=".cg")
                    M, L, A = _merge_state(M, L, A, mj, lj, aj, h_ok, False)
                tl.store(o_ptr, (A / L[:, None]).to(O.dtype.element_ty), mask=h_ok[:, None])
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
