"""The routed experts' grouped GEMM (``kernels/moe/grouped_linear.py``) and the triton experts forward built on it.

- The triton experts forward equals the per-expert path (each expert's gathered tokens through ``linear_fwd``,
  ``silu_mul_packed``, ``linear_fwd``) bit for bit, and each grouped row equals ``linear_fwd`` on that row alone:
  several T (1 included), crowded experts, experts with no tokens, NaN-poisoned outputs.
- No host sync: the launch (grid, scalar arguments, tile constants) is the same for two routings of one shape,
  and the forward runs with every host read of a tensor's value (``item``, ``tolist``, ``int()``, ``bool()``,
  ``nonzero``, ``bincount``, ``unique``) made to raise.
- The gate/up GEMM with the activation in its epilogue (``grouped_linear(..., silu=True)``) equals the GEMM then
  ``silu_mul_packed``.
- Negative control: the same kernel with K cut into two chunks (a different fp32 summation order) gives other
  bits.

On the CPU interpreter the dot's bits come from the test setup's patched dot (``kernels/_interpreter_fix``: fp32
products accumulated k by k, independent of the tile shape), so there the per-row equality is the interpreter's;
on the GPU it is the tensor cores' (``test_gpu_*``, Qwen3-30B-A3B widths).
"""
import pytest
import torch

from areal_tik.kernels import moe
from areal_tik.kernels.linear import linear_fwd
from areal_tik.kernels.moe import grouped_linear as gl
from areal_tik.kernels.moe import routing as rt
from areal_tik.kernels.swiglu import silu_mul_packed_triton
from moe_helpers import expert_weights, poisoned_empty  # noqa: F401  (fixture)

E, H, I = 8, 64, 32
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def per_group_experts(x, wgu, wd, ids):
    """The per-expert path: each expert's tokens gathered (host-side grouping) and run as one batch."""
    T, k = ids.shape
    y = torch.empty((T * k, x.shape[1]), dtype=x.dtype, device=x.device)
    for e, a, tok in moe.expert_groups(ids, wgu.shape[0]):
        y.index_copy_(0, a, linear_fwd(silu_mul_packed_triton(linear_fwd(x.index_select(0, tok), wgu[e])), wd[e]))
    return y.view(T, k, -1)


def crowded_ids(T, k, num_experts, hot=(3, 5), empty=(0, 7)):
    """Half the tokens on expert hot[0], the rest on hot[1], other ranks random; experts ``empty`` get none."""
    allowed = torch.tensor([e for e in range(num_experts) if e not in empty])
    ids = torch.stack([allowed[torch.randperm(len(allowed))[:k]] for _ in range(T)])
    first = torch.where(torch.arange(T) % 2 == 0, hot[0], hot[1])
    clash = (ids == first[:, None]).nonzero()
    for t, r in clash.tolist():                       # keep a token's k experts distinct
        ids[t, r] = ids[t, 0]
    ids[:, 0] = first
    return ids.contiguous()


@pytest.mark.parametrize("T", [1, 7, 48])
def test_experts_equal_per_group_path_and_rows_alone(T, seed_rng, poisoned_empty):  # noqa: F811
    wgu, wd = expert_weights(E, H, I)
    x = torch.randn(T, H).bfloat16()
    ids = crowded_ids(T, 2, E)
    assert not torch.isin(ids, torch.tensor([0, 7])).any()
    y = moe.experts_triton(x, wgu, wd, ids)
    assert not torch.isnan(y).any()
    assert torch.equal(y, per_group_experts(x, wgu, wd, ids))
    plan = rt.routing_plan(ids, E)
    gu = gl.grouped_linear(x, wgu, plan, row_div=2)
    for a in sorted({0, T, 2 * T - 1}):
        t, r = divmod(a, 2)
        assert torch.equal(gu[a], linear_fwd(x[t:t + 1], wgu[int(ids[t, r])])[0])


def test_every_row_written_into_a_poisoned_buffer(seed_rng):
    wgu, _ = expert_weights(E, H, I)
    x = torch.randn(20, H).bfloat16()
    ids = crowded_ids(20, 3, E)
    plan = rt.routing_plan(ids, E)
    out = torch.full((60, 2 * I), float("nan"), dtype=torch.bfloat16)
    gl.grouped_linear(x, wgu, plan, row_div=3, out=out)
    assert not torch.isnan(out).any()
    ref = torch.cat([linear_fwd(x[a // 3:a // 3 + 1], wgu[int(ids.view(-1)[a])]) for a in range(60)])
    assert torch.equal(out, ref)


def test_fused_activation_equals_the_gemm_then_silu_mul(monkeypatch, seed_rng):
    """The gate/up grouped GEMM with its activation (one launch, into a poisoned buffer) gives the bits of the GEMM
    then ``silu_mul_packed``; the experts forward takes it up to FUSED_SILU_MAX_BLOCK_M and the pair above, with
    the same bits."""
    wgu, wd = expert_weights(E, H, I)
    x = torch.randn(20, H).bfloat16()
    ids = crowded_ids(20, 3, E)
    plan = rt.routing_plan(ids, E)
    out = torch.full((60, I), float("nan"), dtype=torch.bfloat16)
    gl.grouped_linear(x, wgu, plan, row_div=3, out=out, silu=True)
    assert not torch.isnan(out).any()
    assert torch.equal(out, silu_mul_packed_triton(gl.grouped_linear(x, wgu, plan, row_div=3)))
    fused = moe.experts_triton_fwd(x, wgu, wd, ids)
    seen = _record_launches(monkeypatch)
    monkeypatch.setattr(moe.experts, "FUSED_SILU_MAX_BLOCK_M", 0)      # the pair at every BLOCK_M
    assert torch.equal(moe.experts_triton_fwd(x, wgu, wd, ids), fused)
    assert [name for name, *_ in seen] == ["grouped_linear_kernel"] * 2


def test_block_table_covers_every_assignment_once(seed_rng):
    for T, k in ((1, 2), (33, 2), (40, 6)):
        ids = crowded_ids(T, k, E, empty=(0,))
        assert ids.shape == (T, k)
        plan = rt.routing_plan(ids, E, block_m=16)
        assert plan.blocks.shape == (rt.max_blocks(T * k, E, 16), 3)
        seen = []
        for e, start, rows in plan.blocks.tolist():
            part = plan.order[start:start + rows]
            assert (ids.view(-1)[part] == e).all() and rows <= 16
            seen += part.tolist()
        assert sorted(seen) == list(range(T * k))
        assert seen == sorted(seen, key=lambda a: (int(ids.view(-1)[a]), a))     # expert, then assignment


def _record_launches(monkeypatch):
    """Every grouped-kernel launch (the plain GEMM and the gate/up GEMM with its activation) from now on as (kernel,
    grid, scalar arguments, keyword constants)."""
    seen = []

    class Recorder:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(gl, name)

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((self.name, grid, tuple(a for a in args if not isinstance(a, torch.Tensor)), kw))
                return self.kernel[grid](*args, **kw)
            return launch
    for name in ("grouped_linear_kernel", "grouped_linear_silu_kernel"):
        monkeypatch.setattr(gl, name, Recorder(name))
    return seen


def test_launch_depends_on_the_shape_only(monkeypatch, seed_rng):
    wgu, wd = expert_weights(E, H, I)
    x = torch.randn(12, H).bfloat16()
    spread = torch.stack([torch.randperm(E)[:2] for _ in range(12)]).contiguous()
    one_expert = torch.stack([torch.full((12,), 4), torch.full((12,), 6)], 1)      # two experts take everything
    seen = _record_launches(monkeypatch)
    moe.experts_triton(x, wgu, wd, spread)
    first = list(seen)
    seen.clear()
    moe.experts_triton(x, wgu, wd, one_expert)
    assert len(first) == 2 and seen == first


def test_forward_reads_nothing_back_to_the_host(monkeypatch, seed_rng):
    wgu, wd = expert_weights(E, H, I)
    x = torch.randn(9, H).bfloat16()
    ids = crowded_ids(9, 2, E)
    want = per_group_experts(x, wgu, wd, ids)

    def refuse(*a, **kw):
        raise AssertionError("host read of a tensor value during the forward")
    for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__", "nonzero", "unique"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for name in ("nonzero", "bincount", "unique"):
        monkeypatch.setattr(torch, name, refuse)
    y = moe.experts_triton_fwd(x, wgu, wd, ids)
    monkeypatch.undo()
    assert torch.equal(y, want)


def test_negative_control_another_k_split_differs(seed_rng):
    """K 128 cut into two chunks of 64 ((0 + p0) + p1) instead of one chain: other bits on some element (fp32, so
    the final rounding keeps every accumulator bit); the linear op with the same split agrees with it (the kernel
    follows its split)."""
    wgu, _ = expert_weights(E, 128, I, torch.float32)
    x = torch.randn(24, 128)
    ids = crowded_ids(24, 2, E)
    plan = rt.routing_plan(ids, E)
    one, two = (gl.grouped_linear(x, wgu, plan, row_div=2, splits=s) for s in (1, 2))
    assert not torch.equal(one, two)
    a = int(plan.order[0])
    assert torch.equal(two[a], linear_fwd(x[a // 2:a // 2 + 1], wgu[int(ids.view(-1)[a])], splits=2)[0])


# ---- GPU: Qwen3-30B-A3B widths ----------------------------------------------------------------------------------

def _qwen3_30b(T, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Hq, Iq, Eq, kq = 2048, 768, 128, 8
    wgu = (torch.randn(Eq, 2 * Iq, Hq, device="cuda", generator=g) * 0.02).bfloat16()
    wd = (torch.randn(Eq, Hq, Iq, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(T, Hq, device="cuda", generator=g).bfloat16()
    ids = crowded_ids(T, kq, Eq, hot=(3, 5), empty=(0, 127)).cuda()
    return x, wgu, wd, ids


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 512, 2048])    # BLOCK_M 16, 16, 32, 128 (block_m_for)
def test_gpu_grouped_rows_equal_linear_fwd_rows(T, seed_rng):
    x, wgu, wd, ids = _qwen3_30b(T, seed_rng)
    k = ids.shape[1]
    plan = rt.routing_plan(ids, wgu.shape[0])
    gu = gl.grouped_linear(x, wgu, plan, row_div=k)
    h = silu_mul_packed_triton(gu)
    y = gl.grouped_linear(h, wd, plan, row_div=1)
    flat = ids.view(-1).tolist()
    rows = range(T * k) if T <= 64 else torch.randperm(T * k)[:512].tolist()
    for a in rows:
        e = flat[a]
        assert torch.equal(gu[a], linear_fwd(x[a // k:a // k + 1], wgu[e])[0]), a
        assert torch.equal(y[a], linear_fwd(h[a:a + 1], wd[e])[0]), a
    assert torch.equal(moe.experts_triton(x, wgu, wd, ids), per_group_experts(x, wgu, wd, ids))


@pytest.mark.gpu
def test_gpu_forward_captures_in_a_cuda_graph_without_syncs(seed_rng):
    """Captured once, replayed on another routing: the eager forward's bits; the eager forward raises no sync."""
    x, wgu, wd, ids = _qwen3_30b(64, seed_rng)
    other = torch.stack([torch.randperm(128, device="cuda")[:8] for _ in range(64)])
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe.experts_triton_fwd(x, wgu, wd, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sx, sids = x.clone(), ids.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe.experts_triton_fwd(sx, wgu, wd, sids)           # warm-up (compiles) off the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.experts_triton_fwd(sx, wgu, wd, sids)
    for routing in (ids, other):
        sids.copy_(routing)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe.experts_triton_fwd(x, wgu, wd, routing))
