"""``linear_silu_mul``: the stacked gate/up GEMM with the SiLU-and-multiply epilogue gives the bits of ``linear``
then ``silu_mul_packed`` (triton: the Triton ops apart; torch_ref: the torch_ref ops apart) for every tile the
stacked GEMM may pick, with and without a bias, at row counts on both sides of ``FUSED_MAX_M``; rows do not depend
on the batch; poisoned outputs are written; it refuses gradients and bad arguments in one line; negative controls
(an epilogue without the GEMM's rounding, swapped halves) differ. CPU interpreter at tiny shapes (one tile), the
GPU at the 1.5B and 7B gate/up shapes and every config of the table."""
import pytest
import torch

from areal_tik.kernels import linear as L, linear_silu_mul as F, swiglu as S
from areal_tik.verify import contract

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
FUSED = {"triton": F.linear_silu_mul_triton, "torch_ref": F.linear_silu_mul_torch}
APART = {"triton": lambda x, w, b: S.silu_mul_packed_triton(L.linear_triton(x, w, b)),
         "torch_ref": lambda x, w, b: S.silu_mul_packed_torch(L.linear_torch(x, w, b))}


def _inputs(M, I, K, dtype, bias, device=DEV, seed=None):
    """x, the stacked gate/up weight (gate rows then up rows) and a bias, fresh from ``seed`` (or the global RNG
    that ``seed_rng`` seeded): gate values spread so SiLU's negative tail and large values both occur."""
    g = torch.Generator().manual_seed(int(torch.randint(2**31, ())) if seed is None else seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = (torch.randn(2 * I, K, generator=g) * 2 * K ** -0.5).to(dtype).to(device)
    b = (torch.randn(2 * I, generator=g)).to(dtype).to(device) if bias else None
    return x, w, b


@pytest.mark.parametrize("backend", ["triton", "torch_ref"])
@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)])
def test_fused_equals_linear_then_silu_mul(backend, dtype, bias, seed_rng):
    for M, I, K in ((1, 24, 40), (5, 40, 72), (17, 33, 64), (3, 8, 130)):   # I, K off the tiles; a K tail
        x, w, b = _inputs(M, I, K, dtype, bias)
        y = FUSED[backend](x, w, b)
        assert y.shape == (M, I) and y.is_contiguous()
        assert torch.equal(y, APART[backend](x, w, b)), (backend, dtype, bias, M, I, K)


def test_above_fused_max_m_runs_apart_with_the_same_bits(monkeypatch, seed_rng):
    """Past FUSED_MAX_M rows the two ops run apart (prefill): the same bits as the fused launch."""
    x, w, b = _inputs(9, 24, 40, torch.bfloat16, True)
    fused = F.linear_silu_mul_triton(x, w, b)
    monkeypatch.setattr(F, "FUSED_MAX_M", 4)
    assert torch.equal(F.linear_silu_mul_triton(x, w, b), fused)
    out = torch.full((9, 24), float("nan"), dtype=torch.bfloat16)
    assert F.linear_silu_mul_fwd(x, w, b, out=out) is out and torch.equal(out, fused)


def test_strided_rows_and_3d_input(seed_rng):
    x, w, b = _inputs(6, 24, 40, torch.bfloat16, False)
    wide = torch.zeros(6, 56, dtype=x.dtype)
    wide[:, :40] = x
    xs = wide[:, :40]                                  # row stride 56: not contiguous
    assert torch.equal(F.linear_silu_mul_triton(xs, w, b), APART["triton"](x, w, b))
    y3 = F.linear_silu_mul_triton(x.view(2, 3, 40), w, b)
    assert y3.shape == (2, 3, 24) and torch.equal(y3.view(6, 24), APART["triton"](x, w, b))


@pytest.mark.parametrize("backend", ["triton", "torch_ref"])
def test_rows_do_not_depend_on_the_batch(backend, seed_rng):
    x, w, b = _inputs(11, 24, 40, torch.bfloat16, True)
    full = FUSED[backend](x, w, b)
    rep = contract.check_row_subset_invariance(lambda a: FUSED[backend](a, w, b), x, [[0], [10], [3, 1], [7, 2, 9]])
    assert rep, rep.summary()
    assert torch.equal(FUSED[backend](x[4:5], w, b), full[4:5])


def test_outputs_written_everywhere(seed_rng):
    x, w, b = _inputs(7, 40, 72, torch.bfloat16, True)
    out = torch.empty(7, 40, dtype=torch.bfloat16)
    assert contract.check_outputs_written(lambda o: F.linear_silu_mul_fwd(x, w, b, out=o), out)


def test_negative_controls_differ(seed_rng):
    """The equality above can fail: an epilogue on the unrounded fp32 GEMM output, or the halves swapped, differ."""
    x, w, b = _inputs(8, 32, 64, torch.bfloat16, False)
    y = F.linear_silu_mul_triton(x, w, None)
    gu32 = L.linear_triton(x.float(), w.float())       # no bf16 rounding of g and u
    unrounded = (torch.nn.functional.silu(gu32[:, :32]) * gu32[:, 32:]).to(torch.bfloat16)
    assert not torch.equal(y, unrounded)
    swapped = torch.cat([w[32:], w[:32]])
    assert not torch.equal(y, F.linear_silu_mul_triton(x, swapped, None))


def test_bad_arguments_fail_in_one_line():
    x, w, b = _inputs(3, 8, 16, torch.bfloat16, True, device="cpu", seed=1)
    with pytest.raises(ValueError, match="even"):
        F.linear_silu_mul_triton(x, w[:15], None)
    with pytest.raises(ValueError, match="forward-only"):
        F.linear_silu_mul_triton(x, w.clone().requires_grad_(True), None)
    with pytest.raises(ValueError, match="does not match weight K"):
        F.linear_silu_mul_torch(x[:, :8], w, b)
    with pytest.raises((ValueError, TypeError)):
        F.linear_silu_mul_triton(x, w.float(), None)
    with pytest.raises(ValueError, match="bias"):
        F.linear_silu_mul_triton(x, w, b[:8])
    with torch.no_grad():                               # no_grad: parameters that require grad are fine
        F.linear_silu_mul_torch(x, w.clone().requires_grad_(True), b)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["1.5b", "7b"])
def test_gpu_fused_equals_apart_every_config(model, seed_rng):
    """The 1.5B and 7B gate/up shapes: the fused launch from every tile config of the table (forced) and from the
    stacked GEMM's own pick, against the linear op then silu_mul_packed, bit for bit, at decode and prefill rows,
    with a bias, and on a row stride TMA cannot take (the pointer twin)."""
    if not ON_GPU:
        pytest.skip("needs a GPU")
    H, inter = {"1.5b": (1536, 8960), "7b": (3584, 18944)}[model]
    for M in (1, 7, 64, 128, 256, 300):
        x, w, b = _inputs(M, inter, H, torch.bfloat16, M == 7)
        ref = APART["triton"](x, w, b)
        assert torch.equal(F.linear_silu_mul_triton(x, w, b), ref), (model, M)
        if M > F.FUSED_MAX_M:
            continue
        for name in L.CONFIGS:
            got = F.linear_silu_mul_fwd(x, w, b, config=L.CONFIGS[name])
            assert torch.equal(got, ref), (model, M, name)
        xv = torch.empty((M, H + 8), dtype=x.dtype, device=DEV)[:, 1:H + 1]
        xv.copy_(x)
        assert torch.equal(F.linear_silu_mul_fwd(xv, w, b, config=L.CONFIGS["tma64_n128"]), ref), (model, M)
