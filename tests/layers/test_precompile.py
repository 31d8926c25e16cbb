"""``layers/precompile.py``: the linear tile configs compiled before the first step are all the
ones ``linear_fwd`` can pick, launched through the model's bound linear, and afterwards no M in
range compiles anything (GPU)."""
import pytest
import torch

from areal_tik.dispatch.bound import bind
from areal_tik.kernels import jit_watch
from areal_tik.kernels.linear import config_name_for, config_names, row_grid
from areal_tik.kernels.linear import selection
from areal_tik.layers.models import build_model
from areal_tik.layers.patch import patch_model
from areal_tik.layers.precompile import linear_shapes, precompile_linears, precompile_plan

# the 1.5B model's linear shapes as the patched HF model runs them (q/o, k/v, gate/up, down), the fused
# qkv and gate_up, lm_head and a value head
SHAPES_15B = [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (2048, 1536), (17920, 1536), (151936, 1536),
              (1, 1536)]


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("lo,hi", [(1, 8192), (64, 16384), (300, 5000)])
def test_grid_reaches_every_config(arch, lo, hi):
    """Brute force over every M in [lo, hi]: the grid misses no config (a missed bucket would be a
    compile inside a step)."""
    for dtype in (torch.bfloat16, torch.float32):
        for n, k in SHAPES_15B:
            every = {config_name_for(m, n, k, dtype, arch) for m in range(lo, hi + 1)}
            assert set(config_names(n, k, dtype, arch, lo, hi)) == every, (n, k, dtype)
    assert row_grid(lo, hi)[0] == lo and row_grid(lo, hi)[-1] == hi


def test_shapes_of_a_patched_model():
    m = patch_model(build_model("tiny-qwen2", device="cpu", seed=0))
    shapes = linear_shapes(m)
    want = {(int(mod.weight.shape[0]), int(mod.weight.shape[1]), mod.weight.dtype, mod.bias is not None)
            for mod in m.modules() if isinstance(mod, torch.nn.Linear)}
    assert set(shapes) == want and len(shapes) == len(want)


@pytest.mark.parametrize("spec", ["linear=triton", "linear=torch_ref"])
def test_plan_launches_the_bound_linear(spec, monkeypatch):
    """Precompilation calls the linear ``patch_model`` bound, with the configs that implementation lists: the
    Triton linear's every reachable config, and nothing for torch_ref (no tile configs to compile)."""
    monkeypatch.setattr(selection, "interpreting", lambda: False)     # plan as on a GPU
    m = patch_model(build_model("tiny-qwen2", device="cpu", seed=0), backend=spec)
    ops = m.lm_head._tik_ops
    plan = precompile_plan(m, max_tokens=4096, min_tokens=1, device="cuda")
    if spec == "linear=torch_ref":
        assert plan == []
        return
    assert plan and all(fn == ops.linear for fn, *_ in plan)
    want = {(n, k, dt, hb, name) for n, k, dt, hb in linear_shapes(m)
            for name in config_names(n, k, dt, "sm_90", 1, 4096)}
    assert {tuple(p[1:]) for p in plan} == want


def test_plan_includes_the_fused_gate_up_configs(monkeypatch):
    """A stacked inference model whose gate/up runs fused with its activation (``linear_silu_mul``) also compiles
    the fused kernels: one launch per config the stacked GEMM can pick up to FUSED_MAX_M rows, through the bound
    fused op; with the fusion off (its backend unlike the linear's) none."""
    from areal_tik.kernels import linear_silu_mul as F
    from areal_tik.layers.stacking import stack_projections
    monkeypatch.setattr(selection, "interpreting", lambda: False)     # plan as on a GPU
    for spec, fused in (("linear=triton,silu_mul_packed=triton,linear_silu_mul=triton", True),
                        ("linear=triton,silu_mul_packed=triton,linear_silu_mul=torch_ref", False)):
        m = patch_model(build_model("tiny-qwen2", device="cpu", seed=0), backend=spec)
        stack_projections(m)
        ops = m.lm_head._tik_ops
        plan = precompile_plan(m, max_tokens=4096, min_tokens=1, device="cuda")
        got = {tuple(p[1:]) for p in plan if p[0] == ops.impls["linear_silu_mul"].fn}
        mlp = m.model.layers[0].mlp._tik_gate_up.weight
        n, k = (int(s) for s in mlp.shape)
        want = {(n, k, mlp.dtype, False, name) for name in config_names(n, k, mlp.dtype, "sm_90", 1, F.FUSED_MAX_M)}
        assert got == (want if fused else set()), spec
        assert {p[0] for p in plan} <= {ops.impls["linear"].fn, ops.impls["linear_silu_mul"].fn}


def test_no_op_off_cuda():
    m = patch_model(build_model("tiny-qwen2", device="cpu", seed=0))
    res = precompile_linears(m, max_tokens=512)
    assert res["configs"] == 0 and res["compiles"] == 0 and res["shapes"] == len(linear_shapes(m))


def test_jit_watch_counts_through_the_hooks():
    """The hook pair counts one compile per miss, by kernel name, and deltas subtract."""
    before = jit_watch.snapshot()

    class Info:
        name = "areal_tik.kernels.linear.triton_kernels.linear_fwd_kernel"
    assert jit_watch._on_cache_miss(fn=Info()) is False
    jit_watch._on_compiled(fn=Info(), repr="linear_fwd_kernel[num_warps=4](M: i32, N: ('i32', 'D'))")
    d = jit_watch.delta(before)
    assert d["compiles"] == 1 and d["by_kernel"] == {"linear_fwd_kernel": 1} and d["seconds"] >= 0
    assert d["specs"] == ["linear_fwd_kernel[num_warps=4](M: i32, N: ('i32', 'D'))"]   # what was specialised
    mid = jit_watch.snapshot()
    for _ in range(jit_watch.RECENT + 3):
        jit_watch._on_compiled(fn=Info())
    d = jit_watch.delta(mid)
    assert d["compiles"] == jit_watch.RECENT + 3 and d["specs"] == ["linear_fwd_kernel"] * jit_watch.RECENT


@pytest.mark.gpu
def test_after_precompile_no_m_compiles():
    """1.5B-shaped linears: after precompile_linears, launching at M across every bucket (and odd M)
    compiles nothing more."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from areal_tik.kernels.linear import linear_fwd
    assert jit_watch.install()
    m = torch.nn.Module()
    dev = torch.device("cuda", torch.cuda.current_device())
    from areal_tik.layers.modules import TikLinear
    m.layers = torch.nn.ModuleList()
    for n, k in SHAPES_15B[:4]:
        lin = torch.nn.Linear(k, n, bias=(n == 256), device=dev, dtype=torch.bfloat16)  # k/v carry a bias
        lin.__class__ = TikLinear
        lin._tik_ops = bind("linear=triton")
        m.layers.append(lin)
    res = precompile_linears(m, max_tokens=8192, min_tokens=1)
    assert res["configs"] > 0
    # the counter sees a real compile (a kernel this process never launched), so the zero below is
    # a measured zero
    import triton
    import triton.language as tl

    @triton.jit
    def _fresh(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) + 1)
    c0 = jit_watch.snapshot()
    one = torch.zeros(1, device=dev)
    _fresh[(1,)](one)
    assert jit_watch.delta(c0)["compiles"] == 1 and one.item() == 1
    before = jit_watch.snapshot()
    g = torch.Generator(device="cpu").manual_seed(0)
    for lin in m.layers:
        for mm in (1, 7, 64, 129, 255, 511, 1000, 2047, 2049, 4096, 8191, 8192):
            x = torch.randn(mm, lin.in_features, generator=g).to(dev, torch.bfloat16)
            linear_fwd(x, lin.weight, lin.bias)
    torch.cuda.synchronize()
    d = jit_watch.delta(before)
    assert d["compiles"] == 0, d


def test_shapes_of_a_stacked_model_include_the_stacked_gemms(monkeypatch):
    """An inference model with stacked projections runs q/k/v and gate/up as one GEMM each, of N = the sum of the
    stacked linears' N: those shapes (and their tile configs) are in the plan in place of the stacked linears'."""
    from areal_tik.layers.stacking import stack_projections
    monkeypatch.setattr(selection, "interpreting", lambda: False)     # plan as on a GPU
    m = patch_model(build_model("tiny-qwen2", device="cpu", seed=0), backend="linear=triton")
    plain = set(linear_shapes(m))
    assert stack_projections(m) > 0
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    qkv = (sum(p.out_features for p in (attn.q_proj, attn.k_proj, attn.v_proj)), attn.q_proj.in_features,
           attn.q_proj.weight.dtype, attn.q_proj.bias is not None)
    gate_up = (mlp.gate_proj.out_features + mlp.up_proj.out_features, mlp.gate_proj.in_features,
               mlp.gate_proj.weight.dtype, False)
    assert qkv not in plain           # a shape of its own (tiny's gate/up N happens to equal its vocab size)
    # the stacked linears themselves no longer run (only without their stack), so their shapes leave the plan
    in_stacks = {id(getattr(layer.self_attn, a)) for layer in m.model.layers for a in ("q_proj", "k_proj", "v_proj")}
    in_stacks |= {id(getattr(layer.mlp, a)) for layer in m.model.layers for a in ("gate_proj", "up_proj")}
    rest = {(int(mod.weight.shape[0]), int(mod.weight.shape[1]), mod.weight.dtype, mod.bias is not None)
            for mod in m.modules() if isinstance(mod, torch.nn.Linear) and id(mod) not in in_stacks}
    assert set(linear_shapes(m)) == rest | {qkv, gate_up}
    k_shape = (attn.k_proj.out_features, attn.k_proj.in_features, attn.k_proj.weight.dtype, True)
    assert k_shape in plain and k_shape not in set(linear_shapes(m))
    plan = {tuple(p[1:]) for p in precompile_plan(m, max_tokens=4096, min_tokens=1, device="cuda")}
    for n, k, dt, hb in (qkv, gate_up):
        names = config_names(n, k, dt, "sm_90", 1, 4096)
        assert names and {(n, k, dt, hb, c) for c in names} <= plan


def test_shapes_in_the_compute_dtype():
    """FSDP2 keeps fp32 master weights and runs the forward in bf16: the configs to compile are
    the bf16 ones (an fp32 model with dtype=bf16 lists bf16 shapes, and their configs are not
    the fp32 family)."""
    m = patch_model(build_model("tiny-qwen2", device="cpu", seed=0, dtype=torch.float32))
    assert {d for _, _, d, _ in linear_shapes(m)} == {torch.float32}
    shapes = linear_shapes(m, torch.bfloat16)
    assert {d for _, _, d, _ in shapes} == {torch.bfloat16} and len(shapes) == len(linear_shapes(m))
    n, k, d, _ = shapes[0]
    assert not any(c.startswith("f32_") for c in config_names(n, k, d, "sm_90", 64, 16384))


def test_moe_plan_runs_each_block_shape_once_per_grouped_tile(monkeypatch):
    """The triton experts list one token count per (grouped-GEMM tile, routing-plan implementation) reachable in
    the range, and the plan holds one block per distinct shape; the torch_ref experts list none."""
    from areal_tik.kernels.moe import grouped_linear, routing
    from areal_tik.layers.precompile import moe_plan
    monkeypatch.setattr(routing, "interpreting", lambda: False)     # block sizes as on a GPU

    def kinds(t, E, k):
        return routing.block_m_for(t * k, E), routing.plan_implementation(t * k, True)
    # (E, k, T range, the tiles reached, how many (tile, plan) kinds)
    for E, k, lo, hi, want, n_kinds in [(128, 8, 1, 8192, {16, 32, 64, 128}, 5), (128, 8, 1, 300, {16, 32}, 3),
                                        (8, 2, 256, 256, {64}, 1), (128, 8, 1, 1, {16}, 1),
                                        (128, 8, 100, 200, {16}, 1), (128, 8, 8000, 8200, {128}, 2),
                                        (128, 8, 1000, 2100, {64, 128}, 2), (128, 8, 2030, 2040, {64, 128}, 2),
                                        (60, 4, 1, 20000, {16, 32, 64, 128}, 6)]:
        counts = grouped_linear.token_counts_per_tile(E, k, lo, hi)
        assert all(lo <= t <= hi for t in counts), (E, k, lo, hi, counts)
        got = {kinds(t, E, k) for t in counts}
        every = {kinds(t, E, k) for t in range(lo, hi + 1)}
        assert got == every and {bm for bm, _ in got} == want and len(counts) == len(got) == n_kinds, \
            (E, k, lo, hi, counts)
    m = patch_model(build_model("tiny-qwen3-moe", device="cpu", seed=0), backend="moe_experts=triton")
    plan = moe_plan(m, max_tokens=4096, min_tokens=1)
    assert len(plan) == 1 and plan[0][1] == grouped_linear.token_counts_per_tile(8, 2, 1, 4096)
    ref = patch_model(build_model("tiny-qwen3-moe", device="cpu", seed=0), backend="moe_experts=torch_ref")
    assert moe_plan(ref, max_tokens=4096, min_tokens=1) == []


@pytest.mark.gpu
def test_after_precompile_stacked_gemms_compile_nothing():
    """A stacked 1.5B-shaped layer (q/k/v with biases, gate/up) on the GPU: after precompile_linears, the stacked
    GEMMs the inference forward launches compile nothing at any M in range."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from areal_tik.kernels.linear import linear_fwd
    from areal_tik.layers.stacking import stack_projections, stacks_of
    assert jit_watch.install()
    dev = torch.device("cuda", torch.cuda.current_device())
    m = patch_model(build_model("qwen2.5-1.5b", device=dev, seed=0, num_hidden_layers=1))
    assert stack_projections(m) == 2
    res = precompile_linears(m, max_tokens=8192, min_tokens=1)
    assert res["configs"] > 0
    stacks = [st for mod in m.modules() for st in stacks_of(mod)]
    assert sorted(int(st.weight.shape[0]) for st in stacks) == [2048, 17920]
    before = jit_watch.snapshot()
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for st in stacks:
            for mm in (1, 7, 64, 129, 255, 511, 1000, 2047, 2049, 4096, 8191, 8192):
                x = torch.randn(mm, st.weight.shape[1], generator=g).to(dev, torch.bfloat16)
                linear_fwd(x, st.weight, st.bias)
    torch.cuda.synchronize()
    d = jit_watch.delta(before)
    assert d["compiles"] == 0, d


@pytest.mark.gpu
def test_after_precompile_moe_blocks_compile_nothing():
    """tiny-qwen3-moe on the GPU, triton experts: after precompile_linears, its MoE blocks at token counts across
    every grouped-GEMM tile compile nothing more (router, grouped GEMMs, combine)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from areal_tik.layers.moe import TikMoE
    assert jit_watch.install()
    dev = torch.device("cuda", torch.cuda.current_device())
    m = patch_model(build_model("tiny-qwen3-moe", device=dev, seed=0), backend="moe_experts=triton")
    res = precompile_linears(m, max_tokens=1024, min_tokens=1)
    assert res["configs"] > 0
    block = next(b for b in m.modules() if isinstance(b, TikMoE))
    before = jit_watch.snapshot()
    with torch.no_grad():
        for t in (1, 7, 64, 100, 128, 300, 512, 1024):
            block(torch.randn((t, block.gate.weight.shape[1]), dtype=block.gate.weight.dtype, device=dev))
    torch.cuda.synchronize()
    assert jit_watch.delta(before)["compiles"] == 0, jit_watch.delta(before)


def test_plan_launches_the_implementation_behind_opaque_ops(monkeypatch):
    """A model on opaque ops (the vLLM plugin compiled: ``ops.linear`` is a custom op taking no tile config) is
    precompiled through the bound implementation itself, with the same plan as the plain ops give."""
    from areal_tik.dispatch.opaque import opaque
    monkeypatch.setattr(selection, "interpreting", lambda: False)     # plan as on a GPU
    plain = patch_model(build_model("tiny-qwen2", device="cpu", seed=0), backend="linear=triton")
    ops = plain.lm_head._tik_ops
    want = precompile_plan(plain, max_tokens=2048, min_tokens=1, device="cuda")
    facade = opaque(ops)
    for mod in plain.modules():
        if getattr(mod, "_tik_ops", None) is ops:
            mod._tik_ops = facade
    got = precompile_plan(plain, max_tokens=2048, min_tokens=1, device="cuda")
    assert got and got == want and all(fn is ops.impls["linear"].fn for fn, *_ in got)


def test_step_token_bound_covers_prefill_budget_and_decode_batch():
    from areal_tik.layers.precompile import step_token_bound
    assert step_token_bound(8192, 64) == 8192      # a prefill step fills the token budget
    assert step_token_bound(16, 256) == 256        # a decode step carries one token per running sequence
