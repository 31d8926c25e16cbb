"""Deterministic exp/log for the torch_ref backend: accurate and position-independent."""
import math

import pytest
import torch

from areal_tik.kernels import _torch_math as tm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_log_accuracy(dtype, seed_rng):
    x = (torch.randn(100_003, dtype=torch.float64) * 30).to(dtype)
    e = tm.exp(x)
    ref = torch.exp(x.double())
    fin = torch.isfinite(ref.to(dtype)) & (ref.abs() > torch.finfo(dtype).tiny)  # normal range
    rel = ((e.double() - ref).abs() / ref.abs())[fin]
    assert float(rel.max()) < (2e-7 if dtype == torch.float32 else 1e-14)
    y = torch.rand(100_003, dtype=torch.float64).to(dtype) * 1e3 + 1e-30
    lg = tm.log(y)
    assert torch.allclose(lg.double(), torch.log(y.double()), rtol=1e-6 if dtype == torch.float32 else 1e-14,
                          atol=1e-7 if dtype == torch.float32 else 1e-14)


def test_special_values():
    x = torch.tensor([-math.inf, math.inf, math.nan, 0.0, -1000.0, 1000.0])
    e = tm.exp(x)
    assert e[0] == 0 and e[1] == math.inf and math.isnan(e[2]) and e[3] == 1 and e[4] == 0 and e[5] == math.inf
    lg = tm.log(torch.tensor([0.0, -1.0, math.inf, math.nan, 1.0]))
    assert lg[0] == -math.inf and math.isnan(lg[1]) and lg[2] == math.inf and math.isnan(lg[3]) and lg[4] == 0


def test_bits_do_not_depend_on_position_or_batch(seed_rng):
    """An element's result is the same alone, at any offset, in any tensor size."""
    x = torch.randn(4099) * 10
    full_e, full_l = tm.exp(x), tm.log(x.abs())
    for start, n in [(0, 1), (3, 5), (17, 33), (4000, 99), (1, 4098)]:
        assert torch.equal(tm.exp(x[start:start + n].clone()), full_e[start:start + n])
        assert torch.equal(tm.log(x[start:start + n].abs().clone()), full_l[start:start + n])
    assert torch.equal(tm.silu(x.bfloat16()[:7].clone()), tm.silu(x.bfloat16())[:7])
