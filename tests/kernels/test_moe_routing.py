"""The routing plan (``kernels/moe/routing.py``): the one-program kernel gives the torch reference's plan element for
element (``torch.equal`` on ``order`` and the whole block table, unused entries included), on random and crowded
routings, ties everywhere (every assignment on one expert), experts with no rows, several block sizes and expert
counts (a power of two and not), into poisoned buffers; the plan's own properties checked from scratch (each
assignment in exactly one block, sorted by expert then assignment). Negative control: a plan built from other ids
differs. ``routing_plan`` takes the kernel up to ``TRITON_MAX_ASSIGNMENTS`` and the torch ops past it."""
import pytest
import torch

from areal_tik.kernels.moe import routing as rt
from moe_helpers import poisoned_empty  # noqa: F401  (fixture)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


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
def test_kernel_plan_equals_the_torch_plan(E, k, kind, poisoned_empty):  # noqa: F811
    g = torch.Generator().manual_seed(hash((E, k, kind)) % 2**31)
    for T in (1, 5, 37):
        ids = _ids(T, k, E, kind, g).to(DEV)
        for bm in (16, 32, 64):
            want = rt.routing_plan_torch(ids, E, bm)
            got = rt.routing_plan_triton(ids, E, bm)
            assert got.blocks.shape == (rt.max_blocks(T * k, E, bm), 3)
            assert torch.equal(got.order, want.order), (T, bm)
            assert torch.equal(got.blocks, want.blocks), (T, bm)
            _check_plan(got, ids.cpu(), E, bm)


def test_int32_ids_and_chunks_past_the_first(poisoned_empty):  # noqa: F811
    """int32 ids (the router's are int64) and more assignments than one placement chunk holds."""
    g = torch.Generator().manual_seed(7)
    E = 16
    ids = _ids(300, 4, E, "skewed", g)
    assert ids.numel() > rt._tiles(E)["CHUNK"] * 2
    for dt in (torch.int32, torch.int64):
        x = ids.to(dt).to(DEV)
        want = rt.routing_plan_torch(x, E, 16)
        got = rt.routing_plan_triton(x, E, 16)
        assert torch.equal(got.order, want.order) and torch.equal(got.blocks, want.blocks)


def test_negative_control_other_ids_give_another_plan():
    g = torch.Generator().manual_seed(3)
    ids = _ids(20, 2, 8, "random", g).to(DEV)
    other = ids.clone()
    other[3, 0], other[3, 1] = other[3, 1].item(), other[3, 0].item()     # one token's ranks swapped
    a, b = rt.routing_plan_triton(ids, 8, 16), rt.routing_plan_triton(other, 8, 16)
    assert not torch.equal(a.order, b.order)


def test_routing_plan_picks_by_assignment_count(monkeypatch):
    calls = []
    monkeypatch.setattr(rt, "routing_plan_triton", lambda *a: calls.append("triton") or "t")
    monkeypatch.setattr(rt, "routing_plan_torch", lambda *a: calls.append("torch") or "r")
    monkeypatch.setattr(rt, "interpreting", lambda: True)
    small = torch.zeros((rt.TRITON_MAX_ASSIGNMENTS // 8, 8), dtype=torch.int64)
    big = torch.zeros((rt.TRITON_MAX_ASSIGNMENTS // 8 + 1, 8), dtype=torch.int64)
    assert rt.routing_plan(small, 128) == "t" and rt.routing_plan(big, 128) == "r"
    assert calls == ["triton", "torch"]


def test_empty_routing():
    ids = torch.zeros((0, 8), dtype=torch.int64, device=DEV)
    p = rt.routing_plan_triton(ids, 128, 16)
    assert p.order.shape == (0,) and p.blocks.shape == (0, 3)


@pytest.mark.gpu
def test_gpu_kernel_plan_equals_torch_at_decode_sizes_and_in_a_graph():
    """Qwen3-30B-A3B routing (128 experts, top-8) at B 1..512: the kernel's plan == the torch plan; captured in a
    CUDA graph and replayed on another routing it gives that routing's plan."""
    g = torch.Generator().manual_seed(11)
    for T in (1, 64, 256, 512):
        ids = _ids(T, 8, 128, "random", g).cuda()
        bm = rt.block_m_for(T * 8, 128)
        want, got = rt.routing_plan_torch(ids, 128, bm), rt.routing_plan_triton(ids, 128, bm)
        assert torch.equal(got.order, want.order) and torch.equal(got.blocks, want.blocks), T
    ids = _ids(64, 8, 128, "skewed", g).cuda()
    static = ids.clone()
    rt.routing_plan_triton(static, 128, 16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = rt.routing_plan_triton(static, 128, 16)
    other = _ids(64, 8, 128, "random", g).cuda()
    static.copy_(other)
    graph.replay()
    want = rt.routing_plan_torch(other, 128, 16)
    assert torch.equal(plan.order, want.order) and torch.equal(plan.blocks, want.blocks)


@pytest.mark.parametrize("num_warps,tile_elems", [(8, 16384), (4, 2048)])
def test_launch_shape_changes_no_plan(num_warps, tile_elems):
    g = torch.Generator().manual_seed(5)
    ids = _ids(90, 8, 128, "skewed", g).to(DEV)
    want = rt.routing_plan_torch(ids, 128, 32)
    got = rt.routing_plan_triton(ids, 128, 32, num_warps, tile_elems)
    assert torch.equal(got.order, want.order) and torch.equal(got.blocks, want.blocks)
