"""``silu_mul_packed`` on a stacked [T, 2I] GEMM output equals ``silu_mul`` on its halves, bit for bit,
on every backend here (and its rows may be strided: a view of a wider tensor)."""
import pytest
import torch

from areal_tik.dispatch import registry

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", ["triton", "torch_ref"])
@pytest.mark.parametrize("T,I", [(1, 8), (5, 96), (17, 1030)])
def test_packed_equals_halves(backend, T, I):
    if backend == "triton" and not registry.select_impl("silu_mul_packed", "triton").available()[0]:
        pytest.skip("no triton here")
    packed = registry.select_impl("silu_mul_packed", backend).fn
    halves = registry.select_impl("silu_mul", backend).fn
    g = torch.Generator().manual_seed(T * 1000 + I)
    wide = (torch.randn(T, 2 * I + 6, generator=g) * 4).to(torch.bfloat16).to(DEV)
    gu = wide[:, 3:3 + 2 * I]                                  # row stride 2I + 6, not contiguous
    with torch.no_grad():
        got = packed(gu)
        want = halves(gu[:, :I].contiguous(), gu[:, I:].contiguous())
    assert got.shape == (T, I) and got.is_contiguous()
    assert torch.equal(got, want)
    # negative control: swapping the halves is a different function
    assert not torch.equal(packed(torch.cat([gu[:, I:], gu[:, :I]], 1)), want)


def test_packed_refuses_odd_width():
    with pytest.raises(ValueError, match="even"):
        registry.select_impl("silu_mul_packed", "torch_ref").fn(torch.zeros(2, 5, dtype=torch.bfloat16))
