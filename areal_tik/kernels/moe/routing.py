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

Three implementations give the same plan, element for element (tests compare them with ``torch.equal``):

- :func:`routing_plan_triton`: one program (``_routing_plan_kernel``): the per-expert counts, then the stable
  placement chunk by chunk (a row's place = its expert's next free slot + the earlier rows of its chunk with the
  same expert), then the block table. One launch instead of ~25 small torch ops; no host sync. Used up to
  :data:`ONE_PROGRAM_MAX_ASSIGNMENTS` assignments (decode batches of a few tokens: its work grows with ``T*k``, one SM
  does it).
- :func:`routing_plan_chunked`: the same steps in two launches: every chunk's counts in parallel, then every
  chunk's placement (its first slot per expert from the counts of the chunks before it, which each program sums
  itself) and the table's entries in parallel; past :data:`PREFIX_MAX_CHUNKS` chunks a third launch between them
  (one program for the prefix sums over the chunks). Used past the one program's range up to
  :data:`CHUNKED_MAX_ASSIGNMENTS`.
- :func:`routing_plan_torch`: device torch ops (``argsort(stable=True)``, ``searchsorted``, ``cumsum``, ...), no
  host sync either; the reference, and the implementation off the GPU and past that size.

:func:`routing_plan` picks one by the assignment count (:func:`plan_implementation`), a shape (not a value), so a
CUDA graph captures any of them.
An id outside ``[0, E)`` (the router never emits one) gets no block: its row is never gathered.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from areal_tik.kernels import interpreting

__all__ = ["RoutingPlan", "routing_plan", "routing_plan_torch", "routing_plan_triton", "routing_plan_chunked",
           "plan_implementation", "max_blocks", "block_m_for", "ONE_PROGRAM_MAX_ASSIGNMENTS", "CHUNKED_MAX_ASSIGNMENTS",
           "PREFIX_MAX_CHUNKS", "chunked_tile_elems", "compile_specs"]

#: the most assignments (T*k) :func:`routing_plan` gives the one-program kernel. Measured on an H100 (CUDA graphs,
#: 128 experts; bench/probes/probe_moe_routing.py), us per plan at 8 / 512 / 2,048 / 4,096 assignments: one program
#: 8.8 / 41.8 / 133.9 / 251.1 (its work grows with the assignments: one SM walks them), the chunked kernel in three launches 12.2 / 12.9 /
#: 13.2 / 13.7, the torch ops 58.5 / 74.7 / 80.8 / 86.3. The one program's time is ~linear between the two measured
#: small sizes, which puts the crossover near 60 assignments (B 8 at top-8)
ONE_PROGRAM_MAX_ASSIGNMENTS = 64
#: the most assignments :func:`routing_plan` gives the chunked kernel (measured to 65,536, 8,192 tokens at
#: top-8: 77.2 us against the torch ops' 137.3; 25.6 vs 133.3 at 16,384)
CHUNKED_MAX_ASSIGNMENTS = 65536


def plan_implementation(assignments: int, on_device: bool) -> str:
    """Which implementation :func:`routing_plan` runs for ``assignments`` (a shape, so a CUDA graph captures one):
    ``"one_program"``, ``"chunked"`` (two or three launches) or ``"torch"`` (off the GPU and the interpreter, or past
    :data:`CHUNKED_MAX_ASSIGNMENTS`)."""
    if not on_device or assignments > CHUNKED_MAX_ASSIGNMENTS:
        return "torch"
    return "one_program" if assignments <= ONE_PROGRAM_MAX_ASSIGNMENTS else "chunked"


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


#: rows per block once the mean rows per expert reach it (prefill chunks; below it, decode sizes)
LARGE_BLOCK_M = 128


def block_m_for(assignments: int, num_experts: int) -> int:
    """Rows per block (speed only, never bits): the mean rows per expert rounded up to a power of two in 16..64,
    or :data:`LARGE_BLOCK_M` once that mean reaches it; 16 under the CPU interpreter."""
    if interpreting():
        return 16
    mean = triton.cdiv(assignments, max(num_experts, 1))
    if mean >= LARGE_BLOCK_M:
        return LARGE_BLOCK_M
    return min(64, max(16, triton.next_power_of_2(mean)))


@triton.jit
def _place_chunk(ids_ptr, order_ptr, s, n, nxt, ex, e_ok, CHUNK: tl.constexpr):
    """Places the rows ``s .. s+CHUNK`` of ``ids``: a row goes to its expert's next free slot (``nxt``, per
    expert) plus the earlier rows of this chunk with the same expert. Returns the chunk's rows per expert."""
    rows_c = tl.arange(0, CHUNK)
    i = s + rows_c
    ids = tl.load(ids_ptr + i, mask=i < n, other=-1).to(tl.int32)
    oh = ((ids[:, None] == ex[None, :]) & e_ok[None, :]).to(tl.int32)           # [CHUNK, BLOCK_E]
    base = tl.sum(oh * nxt[None, :], axis=1)
    earlier = ((ids[None, :] == ids[:, None]) & (rows_c[None, :] < rows_c[:, None])).to(tl.int32)
    placed = tl.sum(oh, axis=1) > 0                             # a valid id (padding lanes hold -1)
    tl.store(order_ptr + base + tl.sum(earlier, axis=1), i.to(tl.int64), mask=placed)
    return tl.sum(oh, axis=0)


@triton.jit
def _chunk_counts(ids_ptr, s, n, ex, e_ok, CHUNK: tl.constexpr):
    """The rows ``s .. s+CHUNK`` of ``ids`` per expert."""
    i = s + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + i, mask=i < n, other=-1).to(tl.int32)
    return tl.sum(((ids[:, None] == ex[None, :]) & e_ok[None, :]).to(tl.int32), axis=0)


@triton.jit
def _table_entries(blocks_ptr, s, cnt, ex, e_ok, n, E, NB, BM, BLOCK_B: tl.constexpr):
    """Writes the block-table entries ``s .. s+BLOCK_B`` (those below NB) from the per-expert counts ``cnt``."""
    lo = tl.cumsum(cnt, axis=0) - cnt                          # first position of each expert in order
    nblk = (cnt + BM - 1) // BM
    blk_end = tl.cumsum(nblk, axis=0)                          # blocks of experts 0..e
    blk_end_ok = tl.where(e_ok, blk_end, 2147483647)
    first_blk = blk_end - nblk
    b = s + tl.arange(0, BLOCK_B)
    owner = tl.sum((blk_end_ok[None, :] <= b[:, None]).to(tl.int32), axis=1)        # E: past the last block
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


@triton.jit(do_not_specialize=["n", "E", "NB", "BM"])
def _routing_plan_kernel(ids_ptr, order_ptr, blocks_ptr, n, E, NB, BM,
                         BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program: counts, stable placement, block table (module docstring). Integer arithmetic only."""
    ex = tl.arange(0, BLOCK_E)
    e_ok = ex < E
    cnt = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s in range(0, n, CHUNK):
        cnt += _chunk_counts(ids_ptr, s, n, ex, e_ok, CHUNK)
    nxt = tl.cumsum(cnt, axis=0) - cnt
    for s in range(0, n, CHUNK):
        nxt += _place_chunk(ids_ptr, order_ptr, s, n, nxt, ex, e_ok, CHUNK)
    for s in range(0, NB, BLOCK_B):
        _table_entries(blocks_ptr, s, cnt, ex, e_ok, n, E, NB, BM, BLOCK_B)


@triton.jit(do_not_specialize=["n", "E"])
def _chunk_counts_kernel(ids_ptr, slots_ptr, n, E, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Three launches, first: program c writes chunk c's rows per expert to ``slots[c, :]`` (0 past E)."""
    c = tl.program_id(0)
    ex = tl.arange(0, BLOCK_E)
    tl.store(slots_ptr + c * BLOCK_E + ex, _chunk_counts(ids_ptr, c * CHUNK, n, ex, ex < E, CHUNK))


@triton.jit(do_not_specialize=["NC"])
def _chunk_slots_kernel(slots_ptr, totals_ptr, NC, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    """Three launches, second (one program): the per-expert totals, then ``slots[c, e]`` overwritten with chunk c's
    first position for expert e in ``order`` (the expert's start plus its rows in the chunks before c)."""
    ex = tl.arange(0, BLOCK_E)
    rc = tl.arange(0, BLOCK_C)
    cnt = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s in range(0, NC, BLOCK_C):
        c = s + rc
        cnt += tl.sum(tl.load(slots_ptr + c[:, None] * BLOCK_E + ex[None, :], mask=(c < NC)[:, None], other=0),
                      axis=0)
    run = tl.cumsum(cnt, axis=0) - cnt
    for s in range(0, NC, BLOCK_C):
        c = s + rc
        ptr = slots_ptr + c[:, None] * BLOCK_E + ex[None, :]
        t = tl.load(ptr, mask=(c < NC)[:, None], other=0)
        tl.store(ptr, run[None, :] + tl.cumsum(t, axis=0) - t, mask=(c < NC)[:, None])
        run += tl.sum(t, axis=0)
    tl.store(totals_ptr + ex, cnt)


@triton.jit(do_not_specialize=["n", "E", "NC", "NB", "BM"])
def _place_and_table_kernel(ids_ptr, slots_ptr, totals_ptr, order_ptr, blocks_ptr, n, E, NC, NB, BM,
                            BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr,
                            PREFIX: tl.constexpr, BLOCK_C: tl.constexpr):
    """The last launch: program p places chunk p (if p < NC) from its slots and writes the table entries
    ``p*BLOCK_B ..`` (if below NB) from the totals. ``PREFIX`` (two launches, NC <= BLOCK_C): ``slots`` still holds
    every chunk's counts, and the program sums them itself (the totals, and the chunks before p for its slots)."""
    p = tl.program_id(0)
    ex = tl.arange(0, BLOCK_E)
    e_ok = ex < E
    if PREFIX:
        rc = tl.arange(0, BLOCK_C)
        counts = tl.load(slots_ptr + rc[:, None] * BLOCK_E + ex[None, :], mask=(rc < NC)[:, None], other=0)
        cnt = tl.sum(counts, axis=0)
        first = tl.cumsum(cnt, axis=0) - cnt + tl.sum(tl.where((rc < p)[:, None], counts, 0), axis=0)
    else:
        cnt = tl.load(totals_ptr + ex)
        first = tl.load(slots_ptr + p * BLOCK_E + ex, mask=p < NC, other=0)
    if p < NC:
        _place_chunk(ids_ptr, order_ptr, p * CHUNK, n, first, ex, e_ok, CHUNK)
    if p * BLOCK_B < NB:
        _table_entries(blocks_ptr, p * BLOCK_B, cnt, ex, e_ok, n, E, NB, BM, BLOCK_B)


def chunked_tile_elems(assignments: int) -> int:
    """The ``[CHUNK, BLOCK_E]`` tile size :func:`routing_plan_chunked` takes for ``assignments`` (speed only).
    Measured on an H100 (CUDA graphs, 128 experts, us per plan; bench/probes/probe_moe_routing.py), two launches
    (up to :data:`PREFIX_MAX_CHUNKS` chunks) at tiles of 2,048 / 4,096 / 8,192 / 16,384 elements: 512 assignments
    **5.4** / 6.5 / 9.2 / 12.8, 2,048 18.7 (three launches: 128 chunks) / **6.9** / 9.8 / 13.0, 16,384 113.7 /
    42.7 / **27.0** / 33.0; earlier, three launches: 65,536 149.6 (4,096) / 77.2 / **49.1**."""
    if assignments <= 512:
        return 2048
    if assignments <= 2048:
        return 4096
    return 8192 if assignments <= 16384 else 16384


#: the most chunks for which the placement programs sum the chunks' counts themselves (two launches instead of
#: three: no program of its own for the prefix sums); a program's sum reads up to this many rows of counts
PREFIX_MAX_CHUNKS = 64


def _tiles(num_experts: int, tile_elems: int = 8192) -> dict:
    """The kernels' constexprs for E experts: BLOCK_E lanes; CHUNK rows per placement step (and BLOCK_B table
    entries per step) so that a ``[CHUNK, BLOCK_E]`` tile holds at most ``tile_elems`` elements (speed only)."""
    be = triton.next_power_of_2(max(num_experts, 1))
    rows = max(16, min(128, tile_elems // be))
    return dict(BLOCK_E=be, CHUNK=rows, BLOCK_B=rows)


def _plan_buffers(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    nb = max_blocks(n, num_experts, block_m)
    order = torch.empty((n,), dtype=torch.int64, device=flat.device)
    blocks = torch.empty((nb, 3), dtype=torch.int32, device=flat.device)
    return flat, n, nb, order, blocks


def routing_plan_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, num_warps: int = 8,
                        tile_elems: int = 8192) -> RoutingPlan:
    """The plan from one launch of ``_routing_plan_kernel`` (ids int32 or int64, contiguous). ``num_warps`` and
    ``tile_elems`` (:func:`_tiles`) change the speed only (probes)."""
    flat, n, nb, order, blocks = _plan_buffers(topk_ids, num_experts, block_m)
    if n:
        _routing_plan_kernel[(1,)](flat, order, blocks, n, num_experts, nb, block_m, num_warps=num_warps,
                                   **_tiles(num_experts, tile_elems))
    return RoutingPlan(order, blocks, block_m, num_experts)


def routing_plan_chunked(topk_ids: torch.Tensor, num_experts: int, block_m: int, num_warps: int = 4,
                         tile_elems: int | None = None, fuse_prefix: bool | None = None) -> RoutingPlan:
    """The plan from two or three launches (ids int32 or int64, contiguous): per-chunk counts (one program per
    chunk of CHUNK rows); past :data:`PREFIX_MAX_CHUNKS` chunks the chunks' first slots per expert (one program, a
    prefix sum over the chunks); then placement (one program per chunk, which up to that many chunks sums the
    earlier chunks' counts itself) and the block table (one program per BLOCK_B entries) in one grid.
    ``num_warps``, ``tile_elems`` (default :func:`chunked_tile_elems`) and ``fuse_prefix`` (default: up to
    :data:`PREFIX_MAX_CHUNKS` chunks) change the speed only."""
    flat, n, nb, order, blocks = _plan_buffers(topk_ids, num_experts, block_m)
    if n:
        t = _tiles(num_experts, tile_elems or chunked_tile_elems(n))
        nc = triton.cdiv(n, t["CHUNK"])
        fuse = nc <= PREFIX_MAX_CHUNKS if fuse_prefix is None else bool(fuse_prefix) and nc <= PREFIX_MAX_CHUNKS
        slots = torch.empty((nc, t["BLOCK_E"]), dtype=torch.int32, device=flat.device)
        totals = slots
        _chunk_counts_kernel[(nc,)](flat, slots, n, num_experts, BLOCK_E=t["BLOCK_E"], CHUNK=t["CHUNK"],
                                    num_warps=num_warps)
        if not fuse:
            totals = torch.empty((t["BLOCK_E"],), dtype=torch.int32, device=flat.device)
            _chunk_slots_kernel[(1,)](slots, totals, nc, BLOCK_E=t["BLOCK_E"], BLOCK_C=t["CHUNK"],
                                      num_warps=num_warps)
        _place_and_table_kernel[(max(nc, triton.cdiv(nb, t["BLOCK_B"])),)](
            flat, slots, totals, order, blocks, n, num_experts, nc, nb, block_m, num_warps=num_warps,
            PREFIX=fuse, BLOCK_C=max(16, triton.next_power_of_2(nc)) if fuse else 1, **t)
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
    """The expert-sorted order and the block table of ``topk_ids [T, k]`` (module docstring), from the
    implementation :func:`plan_implementation` picks for ``T*k``. No host sync."""
    n = topk_ids.numel()
    bm = block_m or block_m_for(n, num_experts)
    kind = plan_implementation(n, topk_ids.is_cuda or interpreting())
    if kind == "one_program":
        return routing_plan_triton(topk_ids.contiguous(), num_experts, bm)
    if kind == "chunked":
        return routing_plan_chunked(topk_ids.contiguous(), num_experts, bm)
    return routing_plan_torch(topk_ids, num_experts, bm)


def compile_specs() -> list[dict]:
    """Compile-check specs: the kernels as launched at 128 experts (Qwen3-MoE) and 60 (Qwen2-MoE), int64 ids."""
    plan = {"ids_ptr": "*i64", "order_ptr": "*i64", "blocks_ptr": "*i32", "n": "i32", "E": "i32", "NB": "i32",
            "BM": "i32"}
    counts = {"ids_ptr": "*i64", "slots_ptr": "*i32", "n": "i32", "E": "i32"}
    slots = {"slots_ptr": "*i32", "totals_ptr": "*i32", "NC": "i32"}
    place = {"ids_ptr": "*i64", "slots_ptr": "*i32", "totals_ptr": "*i32", "order_ptr": "*i64", "blocks_ptr": "*i32",
             "n": "i32", "E": "i32", "NC": "i32", "NB": "i32", "BM": "i32"}
    specs = []
    for e in (128, 60):
        t = _tiles(e)
        specs += [dict(fn=_routing_plan_kernel, signature=plan, constexprs=t, num_warps=8),
                  dict(fn=_chunk_counts_kernel, signature=counts,
                       constexprs=dict(BLOCK_E=t["BLOCK_E"], CHUNK=t["CHUNK"]), num_warps=4),
                  dict(fn=_chunk_slots_kernel, signature=slots,
                       constexprs=dict(BLOCK_E=t["BLOCK_E"], BLOCK_C=t["CHUNK"]), num_warps=4),
                  dict(fn=_place_and_table_kernel, signature=place, constexprs=dict(t, PREFIX=False, BLOCK_C=1),
                       num_warps=4)]
        for n in (512, 2048):                         # the decode tiles (2,048 and 4,096 elements), two launches
            t4 = _tiles(e, chunked_tile_elems(n))
            specs += [dict(fn=_chunk_counts_kernel, signature=counts,
                           constexprs=dict(BLOCK_E=t4["BLOCK_E"], CHUNK=t4["CHUNK"]), num_warps=4),
                      dict(fn=_place_and_table_kernel, signature=place, constexprs=dict(t4, PREFIX=True, BLOCK_C=64),
                           num_warps=4)]
    return specs
