"""The routing plan (``kernels/moe/routing.py``): the one-program and the three-launch kernels give the torch
reference's plan element for element (``torch.equal`` on ``order`` and the whole block table, unused entries
included), on random and crowded routings, ties everywhere (every assignment on one expert), experts with no rows,
several block sizes and expert counts (a power of two and not), into poisoned buffers; the plan's own properties
checked from scratch (each assignment in exactly one block, sorted by expert then assignment). Negative control: a
plan built from other ids differs. ``routing_plan`` takes the one program, the three launches and the torch ops by
the assignment count."""
import pytest
import torch

from areal_tik.kernels.moe import routing as rt
from moe_helpers import poisoned_empty  # noqa: F401  (fixture)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
def routing_plan_three_launches(ids, E, bm, num_warps=4, tile_elems=None):
    """The chunked kernel with its own prefix-sum launch at every size (the path past ``PREFIX_MAX_CHUNKS``)."""
    return rt.routing_plan_chunked(ids, E, bm, num_warps, tile_elems, fuse_prefix=False)


KERNELS = [rt.routing_plan_triton, rt.routing_plan_chunked, routing_plan_three_launches]


def _ids(T, k, E, kind, g):
    if kind == "random":                 # k distinct experts per token
        return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if kind == "one_expert":             # every assignment ties on one expert
        return torch.full((T, k), E // 2, dtype=torch.int64)
    if kind == "skewed":                 # most rows on two experts, a few spread, the first and last unused
        hot = torch.tensor([1, E - 2])
        ids = hot[torch.randint(0, 2, (T, k), generator=g)]
        spread = torch.randint(1, E - 1, (T, k), generator=g)
        return torch.where(torch.rand(T, k, generator=g) < 0.2, spread, ids)
    raise ValueError(kind)


def _check_plan(plan, ids, E, bm):
    """From first principles: every assignment in exactly one block of its expert, in (expert, assignment)
    order, no block longer than bm, unused entries with 0 rows."""
    flat = ids.reshape(-1).tolist()
    seen = []
    for e, start, rows in plan.blocks.tolist():
        assert 0 <= e < E and 0 <= rows <= bm
        part = plan.order[start:start + rows].tolist()
        assert all(flat[a] == e for a in part)
        seen += part
    assert sorted(seen) == list(range(len(flat)))
    assert seen == sorted(seen, key=lambda a: (flat[a], a))


@pytest.mark.parametrize("E,k", [(8, 2), (60, 4), (128, 8)])
@pytest.mark.parametrize("kind", ["random", "one_expert", "skewed"])
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda f: f.__name__)
def test_kernel_plan_equals_the_torch_plan(E, k, kind, kernel, poisoned_empty):  # noqa: F811
    g = torch.Generator().manual_seed(hash((E, k, kind)) % 2**31)
    for T in (1, 5, 37):
        ids = _ids(T, k, E, kind, g).to(DEV)
        for bm in (16, 32, 64):
            want = rt.routing_plan_torch(ids, E, bm)
            got = kernel(ids, E, bm)
            assert got.blocks.shape == (rt.max_blocks(T * k, E, bm), 3)
            assert torch.equal(got.order, want.order), (T, bm)
            assert torch.equal(got.blocks, want.blocks), (T, bm)
            _check_plan(got, ids.cpu(), E, bm)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda f: f.__name__)
def test_int32_ids_and_chunks_past_the_first(kernel, poisoned_empty):  # noqa: F811
    """int32 ids (the router's are int64) and more assignments than one placement chunk holds."""
    g = torch.Generator().manual_seed(7)
    E = 16
    ids = _ids(300, 4, E, "skewed", g)
    assert ids.numel() > rt._tiles(E)["CHUNK"] * 2              # 1,200 rows, chunks of 128
    for dt in (torch.int32, torch.int64):
        x = ids.to(dt).to(DEV)
        for bm in (16, 32):
            want = rt.routing_plan_torch(x, E, bm)
            got = kernel(x, E, bm)
            assert torch.equal(got.order, want.order) and torch.equal(got.blocks, want.blocks)


def test_chunked_many_chunks_few_experts_and_a_short_table(poisoned_empty):  # noqa: F811
    """The three launches with more chunks than one prefix-sum step takes (tile_elems 512 over 8 experts: chunks of
    64 rows, 64 chunks per step) and with fewer table entries than chunks (grid = chunks, most programs write no
    entry); two and three launches over 32 chunks; many more table entries than chunks (E 128, one chunk)."""
    g = torch.Generator().manual_seed(17)
    ids = _ids(2500, 2, 8, "skewed", g).to(DEV)                 # 5,000 rows: 79 chunks, table <= 320 entries
    assert rt.triton.cdiv(ids.numel(), rt._tiles(8, 512)["CHUNK"]) > rt._tiles(8, 512)["CHUNK"]
    for bm in (16, 64):
        want = rt.routing_plan_torch(ids, 8, bm)
        got = rt.routing_plan_chunked(ids, 8, bm, 4, 512)
        assert torch.equal(got.order, want.order) and torch.equal(got.blocks, want.blocks), bm
    ids = _ids(1000, 2, 8, "skewed", g).to(DEV)                 # 2,000 rows: 32 chunks, placement sums them
    assert rt.triton.cdiv(ids.numel(), rt._tiles(8, 512)["CHUNK"]) <= rt.PREFIX_MAX_CHUNKS
    for bm in (16, 64):
        want = rt.routing_plan_torch(ids, 8, bm)
        for fuse in (True, False):
            got = rt.routing_plan_chunked(ids, 8, bm, 4, 512, fuse)
            assert torch.equal(got.order, want.order) and torch.equal(got.blocks, want.blocks), (bm, fuse)
    ids = _ids(6, 8, 128, "random", g).to(DEV)                 # 48 rows, 48 table entries, one chunk
    want = rt.routing_plan_torch(ids, 128, 16)
    got = rt.routing_plan_chunked(ids, 128, 16, 4, 512)
    assert torch.equal(got.order, want.order) and torch.equal(got.blocks, want.blocks)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda f: f.__name__)
def test_negative_control_other_ids_give_another_plan(kernel):
    g = torch.Generator().manual_seed(3)
    ids = _ids(20, 2, 8, "random", g).to(DEV)
    other = ids.clone()
    other[3, 0], other[3, 1] = other[3, 1].item(), other[3, 0].item()     # one token's ranks swapped
    a, b = kernel(ids, 8, 16), kernel(other, 8, 16)
    assert not torch.equal(a.order, b.order)


def test_routing_plan_picks_by_assignment_count(monkeypatch):
    monkeypatch.setattr(rt, "routing_plan_triton", lambda *a: "one")
    monkeypatch.setattr(rt, "routing_plan_chunked", lambda *a: "three")
    monkeypatch.setattr(rt, "routing_plan_torch", lambda *a: "torch")
    monkeypatch.setattr(rt, "interpreting", lambda: True)
    ids = lambda n: torch.zeros((n // 8, 8), dtype=torch.int64)      # noqa: E731
    one, chunked = rt.ONE_PROGRAM_MAX_ASSIGNMENTS, rt.CHUNKED_MAX_ASSIGNMENTS
    assert [rt.routing_plan(ids(n), 128) for n in (8, one, one + 8, chunked, chunked + 8)] == \
        ["one", "one", "three", "three", "torch"]
    monkeypatch.setattr(rt, "interpreting", lambda: False)             # CPU tensors off the interpreter: torch
    assert rt.routing_plan(ids(8), 128) == "torch"


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda f: f.__name__)
def test_empty_routing(kernel):
    ids = torch.zeros((0, 8), dtype=torch.int64, device=DEV)
    p = kernel(ids, 128, 16)
    assert p.order.shape == (0,) and p.blocks.shape == (0, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda f: f.__name__)
def test_gpu_kernel_plan_equals_torch_at_decode_sizes_and_in_a_graph(kernel):
    """Qwen3-30B-A3B routing (128 experts, top-8) at B 1..512 (and 8,192 tokens for the chunked kernels): the
    kernel's plan == the torch plan; captured in a CUDA graph and replayed on another routing it gives that
    routing's plan."""
    g = torch.Generator().manual_seed(11)
    for T in (1, 64, 256, 512) + ((8192,) if kernel is not rt.routing_plan_triton else ()):
        for kind in ("random", "skewed"):
            ids = _ids(T, 8, 128, kind, g).cuda()
            bm = rt.block_m_for(T * 8, 128)
            want, got = rt.routing_plan_torch(ids, 128, bm), kernel(ids, 128, bm)
            assert torch.equal(got.order, want.order) and torch.equal(got.blocks, want.blocks), (T, kind)
    ids = _ids(200, 8, 128, "skewed", g).cuda()
    static = ids.clone()
    kernel(static, 128, 16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = kernel(static, 128, 16)
    other = _ids(200, 8, 128, "random", g).cuda()
    static.copy_(other)
    graph.replay()
    want = rt.routing_plan_torch(other, 128, 16)
    assert torch.equal(plan.order, want.order) and torch.equal(plan.blocks, want.blocks)


@pytest.mark.parametrize("num_warps,tile_elems", [(8, 16384), (4, 2048)])
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda f: f.__name__)
def test_launch_shape_changes_no_plan(num_warps, tile_elems, kernel):
    g = torch.Generator().manual_seed(5)
    ids = _ids(90, 8, 128, "skewed", g).to(DEV)
    want = rt.routing_plan_torch(ids, 128, 32)
    got = kernel(ids, 128, 32, num_warps, tile_elems)
    assert torch.equal(got.order, want.order) and torch.equal(got.blocks, want.blocks)
