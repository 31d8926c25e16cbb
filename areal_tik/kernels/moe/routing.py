"""The routing plan of the grouped expert GEMMs: the assignments sorted by expert and cut into blocks, on the device.

For ``topk_ids [T, k]`` (flat assignments ``a = t*k + r``, expert ``flat[a]``), ``E`` experts and ``BLOCK_M``
rows per block::

    order  int64 [T*k]             the assignments sorted by expert, stable (within an expert in ascending a)
    blocks int32 [max_blocks, 3]   per block b: (expert, first position in order, rows)

Expert e's ``c_e`` assignments occupy ``order[lo_e : lo_e + c_e]`` (``lo_e`` = the assignments of experts
below e) and take ``cdiv(c_e, BLOCK_M)`` consecutive blocks, experts in ascending order; block b of expert e
starts at ``lo_e + (b - first block of e) * BLOCK_M`` and holds ``min(BLOCK_M, what is left)`` rows. The table's
length :func:`max_blocks` depends on ``T*k``, ``E`` and ``BLOCK_M`` only; its entries past the last used block
read ``(E - 1, min(lo_{E-1} + (b - first block of E - 1) * BLOCK_M, T*k - 1), 0)``. The plan decides which rows
a grouped launch gathers, never a row's bits (``grouped_linear``: a row's result depends on its own source row
and expert alone).

Two implementations give the same plan, element for element (tests compare them with ``torch.equal``):

- :func:`routing_plan_triton`: one program (``_routing_plan_kernel``): the per-expert counts, then the stable
  placement chunk by chunk (a row's place = its expert's next free slot + the earlier rows of its chunk with the
  same expert), then the block table. One launch instead of ~25 small torch ops; no host sync. Used up to
  :data:`TRITON_MAX_ASSIGNMENTS` assignments (small decode batches: its work grows with ``T*k``, one SM does it).
- :func:`routing_plan_torch`: device torch ops (``argsort(stable=True)``, ``searchsorted``, ``cumsum``, ...), no
  host sync either; the reference, and the implementation past that size (larger decode batches, prefill).

:func:`routing_plan` picks one by the assignment count, a shape (not a value), so a CUDA graph captures either.
An id outside ``[0, E)`` (the router never emits one) gets no block: its row is never gathered.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from areal_tik.kernels import interpreting

__all__ = ["RoutingPlan", "routing_plan", "routing_plan_torch", "routing_plan_triton", "max_blocks", "block_m_for",
           "TRITON_MAX_ASSIGNMENTS", "compile_specs"]

#: the most assignments (T*k) :func:`routing_plan` gives the one-program kernel. Measured on an H100 (CUDA graphs,
#: 128 experts; bench/probes/probe_moe_routing.py): kernel 8.8 / 41.9 / 134 / 252 us at 8 / 512 / 2,048 / 4,096
#: assignments, the torch ops 59 / 76 / 81 / 86 us: the kernel's work grows with the assignments, the crossover lies
#: between 512 and 2,048 (B 64 x top-8 decode)
TRITON_MAX_ASSIGNMENTS = 512


@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    """``order`` int64 ``[T*k]``: the assignments sorted by expert (stable). ``blocks`` int32
    ``[max_blocks, 3]``: per block (expert, first position in ``order``, rows); 0 rows = no block."""

    order: torch.Tensor
    blocks: torch.Tensor
    block_m: int
    num_experts: int


def max_blocks(assignments: int, num_experts: int, block_m: int) -> int:
    """The static block-table length: an expert with c rows takes ``cdiv(c, block_m)`` blocks, so the blocks of
    T*k rows over E experts number at most ``cdiv(T*k, block_m) + E - 1`` (and at most one per row)."""
    if assignments == 0:
        return 0
    return min(assignments, triton.cdiv(assignments, block_m) + num_experts - 1)


def block_m_for(assignments: int, num_experts: int) -> int:
    """Rows per block (speed only, never bits): the mean rows per expert, rounded up to a power of two in
    16..64; 16 under the CPU interpreter."""
    if interpreting():
        return 16
    return min(64, max(16, triton.next_power_of_2(triton.cdiv(assignments, max(num_experts, 1)))))


@triton.jit(do_not_specialize=["n", "E", "NB", "BM"])
def _routing_plan_kernel(ids_ptr, order_ptr, blocks_ptr, n, E, NB, BM,
                         BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program: counts, stable placement, block table (module docstring). Integer arithmetic only."""
    ex = tl.arange(0, BLOCK_E)
    e_ok = ex < E
    rows_c = tl.arange(0, CHUNK)
    # the assignments of each expert
    cnt = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s in range(0, n, CHUNK):
        i = s + rows_c
        ids = tl.load(ids_ptr + i, mask=i < n, other=-1).to(tl.int32)
        cnt += tl.sum(((ids[:, None] == ex[None, :]) & e_ok[None, :]).to(tl.int32), axis=0)
    lo = tl.cumsum(cnt, axis=0) - cnt                          # first position of each expert in order
    # stable placement: expert's next free slot + the earlier rows of this chunk with the same expert
    nxt = lo
    for s in range(0, n, CHUNK):
        i = s + rows_c
        ids = tl.load(ids_ptr + i, mask=i < n, other=-1).to(tl.int32)
        oh = ((ids[:, None] == ex[None, :]) & e_ok[None, :]).to(tl.int32)       # [CHUNK, BLOCK_E]
        base = tl.sum(oh * nxt[None, :], axis=1)
        earlier = ((ids[None, :] == ids[:, None]) & (rows_c[None, :] < rows_c[:, None])).to(tl.int32)
        placed = tl.sum(oh, axis=1) > 0                         # a valid id (padding lanes hold -1)
        tl.store(order_ptr + base + tl.sum(earlier, axis=1), i.to(tl.int64), mask=placed)
        nxt += tl.sum(oh, axis=0)
    # the block table
    nblk = (cnt + BM - 1) // BM
    blk_end = tl.cumsum(nblk, axis=0)                          # blocks of experts 0..e
    blk_end_ok = tl.where(e_ok, blk_end, 2147483647)
    first_blk = blk_end - nblk
    rows_b = tl.arange(0, BLOCK_B)
    for s in range(0, NB, BLOCK_B):
        b = s + rows_b
        owner = tl.sum((blk_end_ok[None, :] <= b[:, None]).to(tl.int32), axis=1)    # E: past the last block
        e = tl.minimum(owner, E - 1)
        sel = ex[None, :] == e[:, None]
        first = tl.sum(tl.where(sel, first_blk[None, :], 0), axis=1)
        lo_b = tl.sum(tl.where(sel, lo[None, :], 0), axis=1)
        hi_b = lo_b + tl.sum(tl.where(sel, cnt[None, :], 0), axis=1)
        start = lo_b + (b - first) * BM
        rows = tl.where(owner < E, tl.minimum(tl.maximum(hi_b - start, 0), BM), 0)
        start = tl.minimum(tl.maximum(start, 0), tl.maximum(n - 1, 0))
        m = b < NB
        tl.store(blocks_ptr + b * 3, e, mask=m)
        tl.store(blocks_ptr + b * 3 + 1, start, mask=m)
        tl.store(blocks_ptr + b * 3 + 2, rows, mask=m)


def _tiles(num_experts: int, tile_elems: int = 8192) -> dict:
    """The kernel's constexprs for E experts: BLOCK_E lanes; CHUNK rows per placement step (and BLOCK_B table
    entries per step) so that a ``[CHUNK, BLOCK_E]`` tile holds at most ``tile_elems`` elements (speed only)."""
    be = triton.next_power_of_2(max(num_experts, 1))
    rows = max(16, min(128, tile_elems // be))
    return dict(BLOCK_E=be, CHUNK=rows, BLOCK_B=rows)


def routing_plan_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, num_warps: int = 8,
                        tile_elems: int = 8192) -> RoutingPlan:
    """The plan from one launch of ``_routing_plan_kernel`` (ids int32 or int64, contiguous). ``num_warps`` and
    ``tile_elems`` (:func:`_tiles`) change the speed only (probes)."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    nb = max_blocks(n, num_experts, block_m)
    order = torch.empty((n,), dtype=torch.int64, device=flat.device)
    blocks = torch.empty((nb, 3), dtype=torch.int32, device=flat.device)
    if n:
        _routing_plan_kernel[(1,)](flat, order, blocks, n, num_experts, nb, block_m, num_warps=num_warps,
                                   **_tiles(num_experts, tile_elems))
    return RoutingPlan(order, blocks, block_m, num_experts)


def routing_plan_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> RoutingPlan:
    """The plan from device torch ops (no host sync): the reference."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    bm = block_m
    dev = flat.device
    order = torch.argsort(flat, stable=True)
    sorted_e = flat.index_select(0, order)
    experts = torch.arange(num_experts, device=dev, dtype=torch.int64)
    lo = torch.searchsorted(sorted_e, experts)                  # an expert's first position in order
    hi = torch.searchsorted(sorted_e, experts, right=True)      # ... one past its last
    nblk = (hi - lo + (bm - 1)) // bm
    blk_end = torch.cumsum(nblk, 0)                            # blocks of experts 0..e
    b = torch.arange(max_blocks(n, num_experts, bm), device=dev, dtype=torch.int64)
    owner = torch.searchsorted(blk_end, b, right=True)          # block b's expert (E: past the last block)
    e = owner.clamp(max=num_experts - 1)
    first = blk_end.index_select(0, e) - nblk.index_select(0, e)
    start = lo.index_select(0, e) + (b - first) * bm
    rows = torch.where(owner < num_experts, (hi.index_select(0, e) - start).clamp(0, bm), 0)
    blocks = torch.stack([e, start.clamp(0, max(n - 1, 0)), rows], 1).to(torch.int32).contiguous()
    return RoutingPlan(order, blocks, bm, num_experts)


def routing_plan(topk_ids: torch.Tensor, num_experts: int, block_m: int | None = None) -> RoutingPlan:
    """The expert-sorted order and the block table of ``topk_ids [T, k]`` (module docstring): the one-program
    kernel up to :data:`TRITON_MAX_ASSIGNMENTS` assignments, device torch ops past it. No host sync."""
    n = topk_ids.numel()
    bm = block_m or block_m_for(n, num_experts)
    if n <= TRITON_MAX_ASSIGNMENTS and (topk_ids.is_cuda or interpreting()):
        return routing_plan_triton(topk_ids.contiguous(), num_experts, bm)
    return routing_plan_torch(topk_ids, num_experts, bm)


def compile_specs() -> list[dict]:
    """Compile-check specs: the kernel as launched at 128 experts (Qwen3-MoE) and 60 (Qwen2-MoE), int64 ids."""
    sig = {"ids_ptr": "*i64", "order_ptr": "*i64", "blocks_ptr": "*i32", "n": "i32", "E": "i32", "NB": "i32",
           "BM": "i32"}
    return [dict(fn=_routing_plan_kernel, signature=sig, constexprs=_tiles(e), num_warps=8) for e in (128, 60)]
