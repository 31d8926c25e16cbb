"""Unified causal GQA attention: one numerical path for training, prefill, chunked prefill
and paged decode (issue 4).

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

The contract (DESIGN.md section 2): for a query at absolute position p of a sequence, every
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

import math
import os

import torch
import triton
import triton.language as tl

from areal_tik.kernels import _torch_math

__all__ = [
    "attention_varlen", "attention_varlen_triton", "attention_varlen_torch",
    "attention_paged", "attention_paged_triton", "attention_paged_torch",
    "attention_reference", "AttentionVarlenFunction", "varlen_backward",
    "BLOCK_N", "KV_PARTITION", "META", "OPS", "COMPILE_SPECS", "configure", "current_config", "load_tuned",
]

# ---- bit-defining meta-parameters (fingerprinted through META) -------------------------
# Defaults (CPU, and any GPU without an entry in attention_tuned.json). ``configure`` can
# replace them (the tuned JSON for this GPU's arch is applied at import, see the bottom).
BLOCK_N = 64          # KV block of the online softmax, aligned to position 0
KV_PARTITION = 256    # split-KV partition (multiple of BLOCK_N), at absolute positions
LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (64, 128)
TUNED_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_tuned.json")

# Launch tile sizes. These do not define bits (see module docstring, point 3); the tests
# check that by comparing different tiles and regimes (and bench/tune_attention.py checks
# every candidate before it may be committed).
#   fwd:    prefill / chunked / varlen kernel; FLAT=1 walks KV in one loop with the
#           partition merge inside it (software-pipelined across partitions), FLAT=0 in
#           nested partition/block loops. Same arithmetic either way.
#   decode: split-KV kernel; HSPLIT splits the GQA group's query heads over programs.
#   bwd:    dK/dV kernel tiles (BLOCK_M1 x BLOCK_N1) and dQ kernel tiles (BLOCK_M2 x BLOCK_N2).
_DEFAULT_FWD = {64: dict(BLOCK_M=128, num_warps=4, num_stages=3, FLAT=1),
                128: dict(BLOCK_M=128, num_warps=8, num_stages=3, FLAT=1)}
_DEFAULT_DEC = dict(num_warps=4, num_stages=3, HSPLIT=1)
_DEFAULT_BWD = {64: dict(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, num_warps=4, num_stages=3),
                128: dict(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, num_warps=4, num_stages=3)}
_FWD_GPU = {d: dict(c) for d, c in _DEFAULT_FWD.items()}
_DEC_GPU = dict(_DEFAULT_DEC)
_BWD_GPU = {d: dict(c) for d, c in _DEFAULT_BWD.items()}
_INTERP_BLOCK_M = 16
_TUNED_SOURCE = "defaults"

META: dict = {}


def _refresh_meta() -> None:
    """META = the bit-defining constants plus the launch configuration in use (the launch
    tiles are not bit-defining, but fingerprinting them is the conservative choice)."""
    META.clear()
    META.update({
        "BLOCK_N": BLOCK_N, "KV_PARTITION": KV_PARTITION, "denominator": "dot(p_bf16, ones)",
        "fp_fusion": False, "torch_ref": "exact-max, tree-BLOCK_N + ascending blocks",
        "decode": "single launch, last partition program merges ascending",
        "launch": repr((sorted((d, sorted(c.items())) for d, c in _FWD_GPU.items()), sorted(_DEC_GPU.items()),
                        sorted((d, sorted(c.items())) for d, c in _BWD_GPU.items()))),
        "tuned": _TUNED_SOURCE,
    })


def configure(cfg: dict | None = None, source: str = "configure()") -> dict:
    """Set the meta-parameters from a dict like one arch entry of ``attention_tuned.json``:
    ``{"BLOCK_N": 64, "KV_PARTITION": 256, "fwd": {"128": {...}}, "decode": {...},
    "bwd": {"128": {...}}}`` (missing keys keep the defaults). ``None`` restores the
    defaults. Changes the bits (BLOCK_N, KV_PARTITION) and META/the fingerprint; the
    registry reads META when it first loads, so call this before serving/training.
    Returns the previous configuration (for the tuner / tests to restore)."""
    global BLOCK_N, KV_PARTITION, _TUNED_SOURCE
    prev = current_config()
    prev["_source"] = _TUNED_SOURCE
    cfg = dict(cfg or {})
    BLOCK_N = int(cfg.get("BLOCK_N", 64))
    KV_PARTITION = int(cfg.get("KV_PARTITION", 256))
    _FWD_GPU.clear()
    _DEC_GPU.clear()
    _BWD_GPU.clear()
    for d in SUPPORTED_HEAD_DIMS:
        _FWD_GPU[d] = {**_DEFAULT_FWD[d], **{k: int(v) for k, v in cfg.get("fwd", {}).get(str(d), {}).items()}}
        _BWD_GPU[d] = {**_DEFAULT_BWD[d], **{k: int(v) for k, v in cfg.get("bwd", {}).get(str(d), {}).items()}}
    _DEC_GPU.update({**_DEFAULT_DEC, **{k: int(v) for k, v in cfg.get("decode", {}).items()}})
    _TUNED_SOURCE = cfg.get("_source", source) if cfg else "defaults"
    _cfg()
    _refresh_meta()
    return prev


def current_config() -> dict:
    return {"BLOCK_N": BLOCK_N, "KV_PARTITION": KV_PARTITION,
            "fwd": {str(d): dict(c) for d, c in _FWD_GPU.items()}, "decode": dict(_DEC_GPU),
            "bwd": {str(d): dict(c) for d, c in _BWD_GPU.items()}}


from areal_tik.kernels._device import gpu_arch_name as _gpu_arch_name  # noqa: E402


def load_tuned(path: str | None = None, arch: str | None = None) -> bool:
    """Apply the committed tuning for this GPU arch (``attention_tuned.json``: ``{"sm90":
    {...configure() dict..., "_source": "bench/results/..."}}``). ``AREAL_TIK_ATTN_TUNED=0``
    disables it, ``=<path>`` points at another file. Returns True if an entry was applied."""
    env = os.environ.get("AREAL_TIK_ATTN_TUNED")
    if env == "0":
        return False
    path = path or env or TUNED_JSON
    if _interpreting() or not os.path.exists(path):
        return False
    arch = arch or _gpu_arch_name()
    if arch is None:
        return False
    import json
    with open(path) as f:
        table = json.load(f)
    entry = table.get(arch)
    if not entry:
        return False
    import hashlib
    digest = hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()[:12]
    configure(entry, source=f"{os.path.basename(path)}:{arch}:{digest}")
    _refresh_meta()
    META["tuned"] = f"{os.path.basename(path)}:{arch}:{digest}"
    return True


def _alloc(shape, dtype, device) -> torch.Tensor:
    """Every output/workspace allocation goes through here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


_COUNTERS: dict = {}


def _counters(n: int, device) -> torch.Tensor:
    """Zero-initialised int32 arrival counters for the single-launch decode merge, one
    buffer per device. The kernel's last arriving program resets its counter to 0, so the
    buffer stays zero between launches (CUDA-graph safe: no per-call memset; a buffer first
    created during graph capture is zeroed by a captured memset, still correct). Two decode
    launches must not run at the same time on one device (different streams without
    ordering); one engine stream, or graph replays on one stream, never do."""
    key = str(torch.device(device))
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED_COUNTERS.append(buf)   # graphs captured earlier still point at it: never free it
        buf = torch.zeros(max(n, 4096, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.int32,
                          device=device)
        _COUNTERS[key] = buf
    return buf


_RETIRED_COUNTERS: list = []


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _cfg() -> tuple[int, int]:
    """Current (BLOCK_N, KV_PARTITION), read at call time so tests can shrink them."""
    bn, part = BLOCK_N, KV_PARTITION
    if bn < 16 or bn & (bn - 1) or part % bn or part <= 0:
        raise ValueError(f"BLOCK_N={bn} must be a power of two >= 16 and KV_PARTITION={part} a multiple of it")
    return bn, part


# =========================================================================================
# Triton kernels
# =========================================================================================

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
def _attn_fwd_kernel(Q, K, V, O, LSE, BT, CUQ, SEQK, qk_scale,
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
def _attn_decode_kernel(Q, KC, VC, BT, CUQ, SEQK, O, WM, WL, WA, CNT, qk_scale,
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


@triton.jit
def _bwd_load_q_rows(Q, DO, LSE, DELTA, s0, offs_m, m_ok, offs_d, hq, stride_qt, stride_qh, stride_lt):
    """q, dO, lse, delta of query rows ``offs_m`` of one sequence and q head (rows past the
    sequence read 0) and their q/dO offsets."""
    qrow = (s0 + offs_m).to(tl.int64)
    q_off = qrow[:, None] * stride_qt + hq * stride_qh + offs_d[None, :]
    q = tl.load(Q + q_off, mask=m_ok[:, None], other=0.0)
    do = tl.load(DO + q_off, mask=m_ok[:, None], other=0.0)
    lse = tl.load(LSE + qrow * stride_lt + hq, mask=m_ok, other=0.0)
    dl = tl.load(DELTA + qrow * stride_lt + hq, mask=m_ok, other=0.0)
    return q, do, lse, dl, q_off


@triton.jit
def _bwd_kv_offsets(s0, offs_n, offs_d, hk, stride_kt, stride_kh):
    krow = (s0 + offs_n).to(tl.int64)
    return krow[:, None] * stride_kt + hk * stride_kh + offs_d[None, :]


@triton.jit
def _bwd_dkdv_step(q_ptrs_base, Q, DO, LSE, DELTA, k, v, dk, dv, s0, n, start_m, offs_n, offs_d, hq,
                   qk_scale, stride_qt, stride_qh, stride_lt,
                   BLOCK_M: tl.constexpr, MASKED: tl.constexpr):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n
    q, do, lse, dl, q_off = _bwd_load_q_rows(Q, DO, LSE, DELTA, s0, offs_m, m_ok, offs_d, hq,
                                             stride_qt, stride_qh, stride_lt)
    sT = tl.dot(k, tl.trans(q)) * qk_scale
    pT = tl.exp2(sT - lse[None, :])
    if MASKED:
        pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
    # rows past the sequence load q = do = 0, lse = delta = 0: p = 1 finite, and both
    # contributions below are exactly 0, so they need no mask
    dv = tl.dot(pT.to(tl.bfloat16), do, dv)
    dpT = tl.dot(v, tl.trans(do))
    dsT = pT * (dpT - dl[None, :])
    dk = tl.dot(dsT.to(tl.bfloat16), q, dk)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU, qk_scale, sm_scale,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK, dV for one KV block of one sequence and one KV head (sums its GROUP q heads).
    q/do/o share strides (stride_q*), k/v/dk/dv share strides (stride_k*). BLOCK_N is a
    multiple of BLOCK_M: the query blocks overlapping the key block are masked, later ones not.
    Grid (kv-blocks, B, Hkv), kv-blocks run first-first (the longest loops start first)."""
    pid_n = tl.program_id(0)
    seq = tl.program_id(1)
    hk = tl.program_id(2)
    s0 = tl.load(CU + seq)
    n = tl.load(CU + seq + 1) - s0
    start_n = pid_n * BLOCK_N
    if start_n < n:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n
        offs_d = tl.arange(0, HEAD_DIM)
        kv_off = _bwd_kv_offsets(s0, offs_n, offs_d, hk, stride_kt, stride_kh)
        k = tl.load(K + kv_off, mask=n_ok[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=n_ok[:, None], other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        diag_end = tl.minimum(start_n + BLOCK_N, n)
        for g in range(0, GROUP):
            hq = hk * GROUP + g
            for start_m in range(start_n, diag_end, BLOCK_M):
                dk, dv = _bwd_dkdv_step(0, Q, DO, LSE, DELTA, k, v, dk, dv, s0, n, start_m, offs_n, offs_d, hq,
                                        qk_scale, stride_qt, stride_qh, stride_lt, BLOCK_M, True)
            for start_m in range(start_n + BLOCK_N, n, BLOCK_M):
                dk, dv = _bwd_dkdv_step(0, Q, DO, LSE, DELTA, k, v, dk, dv, s0, n, start_m, offs_n, offs_d, hq,
                                        qk_scale, stride_qt, stride_qh, stride_lt, BLOCK_M, False)
        tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok[:, None])
        tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=n_ok[:, None])


@triton.jit
def _bwd_dq_step(K, V, q, do, lse, dl, dq, s0, n, start_n, offs_m, offs_d, hk, qk_scale, stride_kt, stride_kh,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """dq += dS K over one key block; MASKED: a diagonal block (causal mask and sequence end)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    kv_off = _bwd_kv_offsets(s0, offs_n, offs_d, hk, stride_kt, stride_kh)
    if MASKED:
        k = tl.load(K + kv_off, mask=n_ok[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=n_ok[:, None], other=0.0)
    else:
        k = tl.load(K + kv_off)
        v = tl.load(V + kv_off)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        ok = (offs_n[None, :] <= offs_m[:, None]) & n_ok[None, :]
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
    else:
        p = tl.exp2(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - dl[:, None])
    return tl.dot(ds.to(tl.bfloat16), k, dq)


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, qk_scale, sm_scale,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ for BLOCK_M queries of one sequence and one q head (BLOCK_M a multiple of
    BLOCK_N: key blocks before the query block unmasked, the diagonal ones masked).
    Grid (Hq, m-blocks, B), m-blocks last-first."""
    hq = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tl.program_id(2)
    hk = hq // GROUP
    s0 = tl.load(CU + seq)
    n = tl.load(CU + seq + 1) - s0
    start_m = pid_m * BLOCK_M
    if start_m < n:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < n
        offs_d = tl.arange(0, HEAD_DIM)
        q, do, lse, dl, q_off = _bwd_load_q_rows(Q, DO, LSE, DELTA, s0, offs_m, m_ok, offs_d, hq,
                                                 stride_qt, stride_qh, stride_lt)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start_n in range(0, start_m, BLOCK_N):
            dq = _bwd_dq_step(K, V, q, do, lse, dl, dq, s0, n, start_n, offs_m, offs_d, hk, qk_scale,
                              stride_kt, stride_kh, BLOCK_N, False)
        end_n = tl.minimum(n, start_m + BLOCK_M)
        for start_n in range(start_m, end_n, BLOCK_N):
            dq = _bwd_dq_step(K, V, q, do, lse, dl, dq, s0, n, start_n, offs_m, offs_d, hk, qk_scale,
                              stride_kt, stride_kh, BLOCK_N, True)
        tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_ok[:, None])


# =========================================================================================
# validation and launchers
# =========================================================================================

def _qk_scale(scale, head_dim) -> tuple[float, float]:
    """(scale, scale*log2(e)) computed one way for every entry point."""
    s = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"attention: scale must be a positive finite number, got {scale!r}")
    return s, s * LOG2E


def _check_window(window_size):
    if window_size is not None and tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"attention: sliding windows are not supported (window_size={window_size!r}); "
                                  "only full causal attention")


def _check_qkv(q, k, v, name, triton_path):
    for t, nm in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {nm} must be a tensor")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name}: {nm} must be bfloat16, got {t.dtype}")
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k.dim() != v.dim() or k.shape[-2:] != v.shape[-2:]:
        raise ValueError(f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} differ in layout")
    D = q.shape[-1]
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{name}: head dim {D} unsupported; supported: {SUPPORTED_HEAD_DIMS}")
    if k.shape[-1] != D:
        raise ValueError(f"{name}: k/v head dim {k.shape[-1]} != q head dim {D}")
    hq, hkv = q.shape[1], k.shape[-2]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"{name}: Hq={hq} must be a multiple of Hkv={hkv}")
    devs = {q.device, k.device, v.device}
    if len(devs) != 1:
        raise ValueError(f"{name}: q, k, v on different devices {devs}")
    if triton_path and q.device.type != "cuda" and not _interpreting():
        raise ValueError(f"{name}: the triton backend needs CUDA tensors (got {q.device}); use backend='torch_ref'")
    for t, nm in ((q, "q"), (k, "k"), (v, "v")):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {nm} must be contiguous in the head dim")
    return D, hq, hkv


def _check_index(t, nm, name, device, dims=1):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dims:
        raise TypeError(f"{name}: {nm} must be an int32 tensor with {dims} dim(s), got "
                        f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if t.device != device:
        raise ValueError(f"{name}: {nm} on {t.device}, expected {device}")


def _fwd_tiles(D):
    if _interpreting():
        return dict(BLOCK_M=_INTERP_BLOCK_M, num_warps=4, num_stages=1, FLAT=_FWD_GPU[D].get("FLAT", 1))
    return dict(_FWD_GPU[D])


def _launch_fwd(q, k, v, out, lse, block_table, cu_q, seqlens_k, max_seqlen_q, qk_scale, paged, page_size,
                block_m=None):
    D, hq, hkv = q.shape[-1], q.shape[1], k.shape[-2]
    bn, part = _cfg()
    tiles = _fwd_tiles(D)
    if block_m is not None:
        tiles["BLOCK_M"] = block_m
    B = cu_q.shape[0] - 1
    if B == 0 or max_seqlen_q == 0:
        return
    grid = (hq, triton.cdiv(max_seqlen_q, tiles["BLOCK_M"]), B)
    if paged:
        kk, vv = k.view(-1, hkv, D), v.view(-1, hkv, D)
        bt, sk, sbt = block_table, seqlens_k, block_table.stride(0)
    else:
        kk, vv, bt, sk, sbt = k, v, cu_q, cu_q, 0
    lse_t = lse if lse is not None else out
    _attn_fwd_kernel[grid](
        q, kk, vv, out, lse_t, bt, cu_q, sk, qk_scale,
        q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), vv.stride(0), vv.stride(1),
        out.stride(0), out.stride(1), (lse.stride(0) if lse is not None else 0), sbt,
        GROUP=hq // hkv, HEAD_DIM=D, BLOCK_M=tiles["BLOCK_M"], BLOCK_N=bn, PARTITION=part,
        PAGED=paged, PAGE_SIZE=page_size, STORE_LSE=lse is not None, FLAT=int(tiles.get("FLAT", 1)),
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"], enable_fp_fusion=False)


def _varlen_checks(q, k, v, cu_seqlens, max_seqlen, triton_path):
    D, hq, hkv = _check_qkv(q, k, v, "attention_varlen", triton_path)
    if k.dim() != 3 or k.shape[0] != q.shape[0]:
        raise ValueError(f"attention_varlen: k/v must be [T, Hkv, D] with T={q.shape[0]}, got {tuple(k.shape)}")
    _check_index(cu_seqlens, "cu_seqlens", "attention_varlen", q.device)
    if cu_seqlens.shape[0] < 1:
        raise ValueError("attention_varlen: cu_seqlens needs at least one entry")
    if int(max_seqlen) < 0:
        raise ValueError("attention_varlen: max_seqlen must be >= 0")
    return D, hq, hkv


def _varlen_fwd(q, k, v, cu_seqlens, max_seqlen, qk_scale, want_lse, block_m=None):
    out = _alloc(q.shape, q.dtype, q.device)
    lse = _alloc((q.shape[0], q.shape[1]), torch.float32, q.device) if want_lse else None
    _launch_fwd(q, k, v, out, lse, None, cu_seqlens, None, int(max_seqlen), qk_scale, False, 16, block_m)
    return out, lse


def _bwd_tiles(D):
    if _interpreting():
        return dict(BLOCK_M1=16, BLOCK_N1=32, BLOCK_M2=32, BLOCK_N2=16, num_warps=4, num_stages=1)
    t = dict(_BWD_GPU[D])
    if t["BLOCK_N1"] % t["BLOCK_M1"] or t["BLOCK_M2"] % t["BLOCK_N2"]:
        raise ValueError(f"attention backward tiles {t}: BLOCK_N1 must be a multiple of BLOCK_M1 and "
                         "BLOCK_M2 a multiple of BLOCK_N2")
    return t


class AttentionVarlenFunction(torch.autograd.Function):
    """Autograd for the Triton varlen forward; backward: :mod:`areal_tik.kernels.attention_backward` (the
    Triton flash-attention-2 recompute :func:`varlen_backward`, or PyTorch's flash backward kernel, on the
    saved output and lse; dq/dk/dv correct, not bit-invariant)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale):
        sm_scale, qk_scale = _qk_scale(scale, q.shape[-1])
        out, lse = _varlen_fwd(q, k, v, cu_seqlens, max_seqlen, qk_scale, True)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.sm_scale, ctx.qk_scale = int(max_seqlen), sm_scale, qk_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        from areal_tik.kernels.attention_backward import varlen_attention_backward
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = varlen_attention_backward(q, k, v, out, lse, cu, ctx.max_seqlen, ctx.sm_scale, ctx.qk_scale,
                                               dout)
        return dq, dk, dv, None, None, None


def varlen_backward(q, k, v, out, lse, cu_seqlens, max_seqlen, sm_scale, qk_scale, dout):
    """dq, dk, dv of the causal varlen attention from its saved inputs, bf16 output ``out`` and base-2
    log-sum-exp ``lse`` ``[T, Hq]`` fp32 (scores scaled by ``qk_scale`` = ``sm_scale`` * log2(e)): the
    flash-attention-2 style Triton recompute (correct, not bit-invariant). Used by the Triton forward's
    autograd and by the CUDA forward's (csrc writes the same lse)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dout = dout.contiguous()
    D, hq, hkv = q.shape[-1], q.shape[1], k.shape[1]
    delta = (dout.float() * out.float()).sum(-1).contiguous()
    dq, dk, dv = _alloc(q.shape, q.dtype, q.device), _alloc(k.shape, k.dtype, k.device), \
        _alloc(v.shape, v.dtype, v.device)
    t = _bwd_tiles(D)
    B = cu_seqlens.shape[0] - 1
    if B > 0 and max_seqlen > 0:
        common = dict(GROUP=hq // hkv, HEAD_DIM=D, num_warps=t["num_warps"], num_stages=t["num_stages"])
        _attn_bwd_dkdv_kernel[(triton.cdiv(max_seqlen, t["BLOCK_N1"]), B, hkv)](
            q, k, v, dout, lse, delta, dk, dv, cu_seqlens, qk_scale, sm_scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
            BLOCK_M=t["BLOCK_M1"], BLOCK_N=t["BLOCK_N1"], **common)
        _attn_bwd_dq_kernel[(hq, triton.cdiv(max_seqlen, t["BLOCK_M2"]), B)](
            q, k, v, dout, lse, delta, dq, cu_seqlens, qk_scale, sm_scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
            BLOCK_M=t["BLOCK_M2"], BLOCK_N=t["BLOCK_N2"], **common)
    else:
        dq.zero_(), dk.zero_(), dv.zero_()
    return dq, dk, dv


def attention_varlen_triton(q, k, v, cu_seqlens, max_seqlen, scale=None, window_size=None):
    """R1 packed causal GQA attention (Triton). q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` bf16,
    ``cu_seqlens`` int32 ``[B+1]``, ``max_seqlen`` >= the longest segment (host int).
    Returns ``[T, Hq, D]`` bf16. Each token's output bits depend only on its sequence's
    tokens up to it and equal ``attention_paged`` for the same position (module docstring).
    Autograd when any input requires grad; the output bits are the same either way."""
    _check_window(window_size)
    _varlen_checks(q, k, v, cu_seqlens, max_seqlen, True)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return AttentionVarlenFunction.apply(q, k, v, cu_seqlens, int(max_seqlen), scale)
    _, qk_scale = _qk_scale(scale, q.shape[-1])
    return _varlen_fwd(q, k, v, cu_seqlens, max_seqlen, qk_scale, False)[0]


def _paged_checks(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q, triton_path):
    name = "attention_paged"
    D, hq, hkv = _check_qkv(q, k_cache, v_cache, name, triton_path)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: caches must be [num_pages, page_size, Hkv, D] of one shape, got "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    ps = k_cache.shape[1]
    if ps < 16 or ps > 256 or ps & (ps - 1):
        raise ValueError(f"{name}: page size {ps} must be a power of two in 16..256")
    if triton_path and not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{name}: caches must be contiguous")
    _check_index(block_table, "block_table", name, q.device, dims=2)
    _check_index(cu_seqlens_q, "cu_seqlens_q", name, q.device)
    _check_index(seqlens_k, "seqlens_k", name, q.device)
    B = cu_seqlens_q.shape[0] - 1
    if seqlens_k.shape[0] != B or block_table.shape[0] < B:
        raise ValueError(f"{name}: {B} sequences but seqlens_k has {seqlens_k.shape[0]} entries and "
                         f"block_table {block_table.shape[0]} rows")
    if int(max_seqlen_q) < 0:
        raise ValueError(f"{name}: max_seqlen_q must be >= 0")
    return D, hq, hkv, ps, B


def attention_paged_triton(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q,
                           scale=None, window_size=None):
    """R2 prefill / R3 chunked prefill / R4 decode over the paged KV cache (Triton).

    q ``[Tq, Hq, D]`` bf16; caches ``[num_pages, page_size, Hkv, D]`` bf16 contiguous;
    ``block_table`` int32 ``[B, max_pages]``; ``cu_seqlens_q`` int32 ``[B+1]``;
    ``seqlens_k`` int32 ``[B]`` (includes the queries, which are each sequence's last
    positions); ``max_seqlen_q`` host int. ``max_seqlen_q == 1`` takes the split-KV decode
    path (GQA heads packed in MMA rows, partitions of ``KV_PARTITION`` tokens merged in
    ascending order by the last partition program of the same launch), else the prefill
    kernel; both give the same bits per query position. No host synchronisation; decode
    uses a persistent per-device counter buffer that returns to zero after every launch
    (CUDA-graph safe; two decode launches must not run concurrently on one device)."""
    _check_window(window_size)
    D, hq, hkv, ps, B = _paged_checks(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k,
                                      max_seqlen_q, True)
    _, qk_scale = _qk_scale(scale, D)
    out = _alloc(q.shape, q.dtype, q.device)
    if B == 0 or int(max_seqlen_q) == 0:
        return out
    if int(max_seqlen_q) == 1:
        _decode(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, out, qk_scale)
    else:
        _launch_fwd(q, k_cache, v_cache, out, None, block_table, cu_seqlens_q, seqlens_k, int(max_seqlen_q),
                    qk_scale, True, ps)
    return out


def _decode(q, k_cache, v_cache, block_table, cu_q, seqlens_k, out, qk_scale):
    D, hq, hkv, ps = q.shape[-1], q.shape[1], k_cache.shape[2], k_cache.shape[1]
    bn, part = _cfg()
    B = cu_q.shape[0] - 1
    group = hq // hkv
    # interpreter: tiny launch settings, but the configured HSPLIT (a launch choice the CPU
    # tests check for bit-equality; the defaults keep HSPLIT=1)
    cfg = (dict(num_warps=4, num_stages=1, HSPLIT=_DEC_GPU.get("HSPLIT", 1)) if _interpreting()
           else dict(_DEC_GPU))
    hsplit = int(cfg.get("HSPLIT", 1))
    if hsplit < 1 or group % hsplit:
        hsplit = 1                     # not bit-defining: fall back for groups it does not divide
    block_h = max(16, triton.next_power_of_2(group // hsplit))
    n_parts = max(1, triton.cdiv(block_table.shape[1] * ps, part))
    dev = q.device
    wm = _alloc((B * hq * n_parts,), torch.float32, dev)
    wl = _alloc((B * hq * n_parts,), torch.float32, dev)
    wa = _alloc((B * hq * n_parts * D,), torch.float32, dev)
    cnt = _counters(B * hkv * hsplit, dev)
    kk, vv = k_cache.view(-1, hkv, D), v_cache.view(-1, hkv, D)
    _attn_decode_kernel[(n_parts, hkv * hsplit, B)](
        q, kk, vv, block_table, cu_q, seqlens_k, out, wm, wl, wa, cnt, qk_scale,
        q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), vv.stride(0), vv.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), n_parts, hq, hkv * hsplit,
        GROUP=group, HEAD_DIM=D, BLOCK_H=block_h, BLOCK_N=bn, PARTITION=part, PAGE_SIZE=ps, HSPLIT=hsplit,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=False)


# =========================================================================================
# torch_ref: same contract on a CPU, built from exactly-rounded ops in a fixed order
# =========================================================================================

def _tree_sum_blocks(x: torch.Tensor, dim: int, bn: int) -> torch.Tensor:
    """Sum over ``dim`` (length a multiple of bn): fixed pairwise tree inside each aligned
    block of bn, then ascending over blocks. Zero padding is an exact no-op."""
    x = x.movedim(dim, -1)
    nb = x.shape[-1] // bn
    x = x.reshape(*x.shape[:-1], nb, bn)
    w = bn
    while w > 1:
        w //= 2
        x = x[..., :w] + x[..., w:2 * w]
    x = x[..., 0]
    total = x[..., 0]
    for b in range(1, nb):
        total = total + x[..., b]
    return total


def _torch_attend(q, pos, k, v, scale, bn):
    """q [n, Hq, D] bf16 at absolute positions pos [n]; k/v [Lk, Hkv, D] bf16 = the
    sequence's keys 0..Lk-1 (Lk > max(pos)). Returns fp32 [n, Hq, D] before the bf16 cast."""
    n, hq, D = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    lpad = -(-lk // bn) * bn
    kf = torch.zeros(lpad, hq, D, dtype=torch.float32, device=q.device)
    vf = torch.zeros_like(kf)
    kf[:lk] = k.float().repeat_interleave(g, dim=1)
    vf[:lk] = v.float().repeat_interleave(g, dim=1)
    kT = kf.permute(1, 2, 0)            # [Hq, D, L]
    vT = vf.permute(1, 0, 2)            # [Hq, L, D]
    qf = q.float()
    j = torch.arange(lpad, device=q.device)
    out = torch.empty(n, hq, D, dtype=torch.float32, device=q.device)
    chunk = max(1, (1 << 22) // max(1, hq * lpad * D))
    for c0 in range(0, n, chunk):
        qc, pc = qf[c0:c0 + chunk], pos[c0:c0 + chunk]
        s = torch.zeros(qc.shape[0], hq, lpad, dtype=torch.float32, device=q.device)
        for d in range(D):               # exact products, ascending sum over d
            s = s + qc[:, :, d, None] * kT[None, :, d, :]
        s = s * scale
        valid = (j[None, :] <= pc[:, None])[:, None, :]
        s = torch.where(valid, s, torch.full_like(s, -math.inf))
        m = s.amax(-1, keepdim=True)     # exact
        p = torch.where(valid, _torch_math.exp(s - m), torch.zeros_like(s))
        l = _tree_sum_blocks(p, -1, bn)                                  # [c, Hq]
        acc = _tree_sum_blocks(p[..., None] * vT[None], -2, bn)          # [c, Hq, D]
        out[c0:c0 + qc.shape[0]] = acc / l[..., None]
    return out


class _VarlenTorchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale):
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.scale = scale
        return _varlen_torch_fwd(q, k, v, cu_seqlens, scale)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, cu = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(k, dtype=torch.float32), \
            torch.zeros_like(v, dtype=torch.float32)
        g = q.shape[1] // k.shape[1]
        bounds = cu.tolist()
        for b in range(len(bounds) - 1):
            s0, s1 = bounds[b], bounds[b + 1]
            if s1 == s0:
                continue
            qf = q[s0:s1].float().transpose(0, 1)
            kf = k[s0:s1].float().repeat_interleave(g, 1).transpose(0, 1)
            vf = v[s0:s1].float().repeat_interleave(g, 1).transpose(0, 1)
            do = dout[s0:s1].float().transpose(0, 1)
            n = s1 - s0
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            sc = (qf @ kf.transpose(1, 2)) * ctx.scale
            p = torch.softmax(sc.masked_fill(~mask, -math.inf), -1)
            dvh = p.transpose(1, 2) @ do
            dp = do @ vf.transpose(1, 2)
            ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * ctx.scale
            dq[s0:s1] = (ds @ kf).transpose(0, 1)
            dkh = (ds.transpose(1, 2) @ qf).transpose(0, 1)
            dk[s0:s1] = dkh.reshape(n, k.shape[1], g, -1).sum(2)
            dv[s0:s1] = dvh.transpose(0, 1).reshape(n, k.shape[1], g, -1).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _varlen_torch_fwd(q, k, v, cu_seqlens, scale):
    bn, _ = _cfg()
    out = _alloc(q.shape, q.dtype, q.device)
    bounds = cu_seqlens.tolist()
    for b in range(len(bounds) - 1):
        s0, s1 = bounds[b], bounds[b + 1]
        if s1 > s0:
            pos = torch.arange(s1 - s0, device=q.device)
            out[s0:s1] = _torch_attend(q[s0:s1], pos, k[s0:s1], v[s0:s1], scale, bn).to(q.dtype)
    return out


def attention_varlen_torch(q, k, v, cu_seqlens, max_seqlen, scale=None, window_size=None):
    """torch_ref of :func:`attention_varlen_triton`: same layouts and invariance contract,
    its own bits (two-pass exact-max softmax; fixed-tree sums; deterministic exp).
    Autograd through a float32 recompute backward."""
    _check_window(window_size)
    _varlen_checks(q, k, v, cu_seqlens, max_seqlen, False)
    sm_scale, _ = _qk_scale(scale, q.shape[-1])
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _VarlenTorchFunction.apply(q, k, v, cu_seqlens, sm_scale)
    return _varlen_torch_fwd(q, k, v, cu_seqlens, sm_scale)


def _gather_seq_kv(k_cache, v_cache, block_table, i, lk):
    ps = k_cache.shape[1]
    j = torch.arange(lk, device=k_cache.device)
    slots = block_table[i].long()[j // ps] * ps + j % ps
    kc = k_cache.reshape(-1, *k_cache.shape[2:])
    vc = v_cache.reshape(-1, *v_cache.shape[2:])
    return kc[slots], vc[slots]


def attention_paged_torch(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q,
                          scale=None, window_size=None):
    """torch_ref of :func:`attention_paged_triton` (same layouts and contract, own bits;
    bitwise equal to :func:`attention_varlen_torch` for the same query position)."""
    _check_window(window_size)
    D, hq, hkv, ps, B = _paged_checks(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k,
                                      max_seqlen_q, False)
    sm_scale, _ = _qk_scale(scale, D)
    bn, _ = _cfg()
    out = _alloc(q.shape, q.dtype, q.device)
    cu = cu_seqlens_q.tolist()
    sk = seqlens_k.tolist()
    for i in range(B):
        n = cu[i + 1] - cu[i]
        if n == 0:
            continue
        lk = sk[i]
        if lk < n:
            raise ValueError(f"attention_paged: sequence {i} has {n} queries but seqlens_k={lk}")
        kk, vv = _gather_seq_kv(k_cache, v_cache, block_table, i, lk)
        pos = torch.arange(lk - n, lk, device=q.device)
        out[cu[i]:cu[i + 1]] = _torch_attend(q[cu[i]:cu[i + 1]], pos, kk, vv, sm_scale, bn).to(q.dtype)
    return out


# =========================================================================================
# float64 reference
# =========================================================================================

def attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k=None, scale=None):
    """Float64 causal GQA attention. Sequence i has queries ``q[cu_q[i]:cu_q[i+1]]`` (its
    last positions) and keys/values ``k[cu_k[i]:cu_k[i+1]]`` (all its positions from 0);
    ``cu_seqlens_k`` defaults to ``cu_seqlens_q`` (self-attention). Returns float64."""
    cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    sm = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        n, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if n == 0:
            continue
        qd = q[cq[i]:cq[i + 1]].double().transpose(0, 1)
        kd = k[ck[i]:ck[i + 1]].double().repeat_interleave(g, 1).transpose(0, 1)
        vd = v[ck[i]:ck[i + 1]].double().repeat_interleave(g, 1).transpose(0, 1)
        s = (qd @ kd.transpose(1, 2)) * sm
        pos = torch.arange(lk - n, lk, device=q.device)
        mask = torch.arange(lk, device=q.device)[None, :] <= pos[:, None]
        s = s.masked_fill(~mask, -math.inf)
        out[cq[i]:cq[i + 1]] = (torch.softmax(s, -1) @ vd).transpose(0, 1)
    return out


# =========================================================================================
# tables
# =========================================================================================

attention_varlen = attention_varlen_triton
attention_paged = attention_paged_triton

OPS = {
    "attention_varlen": {"triton": attention_varlen_triton, "torch_ref": attention_varlen_torch},
    "attention_paged": {"triton": attention_paged_triton, "torch_ref": attention_paged_torch},
}


def _sig(fn, types: dict, constexprs: dict) -> dict:
    sig = {}
    for a in fn.arg_names:
        if a in constexprs:
            sig[a] = "constexpr"
        elif a in types:
            sig[a] = types[a]
        elif a.startswith("stride") or a.startswith("n_"):
            sig[a] = "i32"
        elif a in ("qk_scale", "sm_scale"):
            sig[a] = "fp32"
        else:
            raise KeyError(f"no compile-check type for {fn.__name__}.{a}")
    return sig


def _compile_specs():
    specs = []
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    fwd_t = dict(Q=bf, K=bf, V=bf, O=bf, LSE=f32, BT=i32, CUQ=i32, SEQK=i32)
    for D in SUPPORTED_HEAD_DIMS:
        t = _FWD_GPU[D]
        for paged, ps, lse in ((False, 16, True), (True, 16, False), (True, 256, False)):
            c = dict(GROUP=4, HEAD_DIM=D, BLOCK_M=t["BLOCK_M"], BLOCK_N=BLOCK_N, PARTITION=KV_PARTITION,
                     PAGED=paged, PAGE_SIZE=ps, STORE_LSE=lse, FLAT=int(t.get("FLAT", 1)))
            specs.append(dict(fn=_attn_fwd_kernel, signature=_sig(_attn_fwd_kernel, fwd_t, c), constexprs=c,
                              num_warps=t["num_warps"], num_stages=t["num_stages"]))
        dec = _DEC_GPU
        for group, ps in ((4, 16), (8, 64)):
            c = dict(GROUP=group, HEAD_DIM=D, BLOCK_H=16, BLOCK_N=BLOCK_N, PARTITION=KV_PARTITION, PAGE_SIZE=ps,
                     HSPLIT=int(dec.get("HSPLIT", 1)))
            ty = dict(Q=bf, KC=bf, VC=bf, BT=i32, CUQ=i32, SEQK=i32, O=bf, WM=f32, WL=f32, WA=f32, CNT=i32)
            specs.append(dict(fn=_attn_decode_kernel, signature=_sig(_attn_decode_kernel, ty, c), constexprs=c,
                              num_warps=dec["num_warps"], num_stages=dec["num_stages"]))
        b = _BWD_GPU[D]
        ty = dict(Q=bf, K=bf, V=bf, DO=bf, LSE=f32, DELTA=f32, DK=bf, DV=bf, DQ=bf, CU=i32)
        for fn, bm, bn_ in ((_attn_bwd_dkdv_kernel, b["BLOCK_M1"], b["BLOCK_N1"]),
                            (_attn_bwd_dq_kernel, b["BLOCK_M2"], b["BLOCK_N2"])):
            c = dict(GROUP=4, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn_)
            specs.append(dict(fn=fn, signature=_sig(fn, ty, c), constexprs=c,
                              num_warps=b["num_warps"], num_stages=b["num_stages"]))
    return specs


_refresh_meta()
load_tuned()
COMPILE_SPECS = _compile_specs()
