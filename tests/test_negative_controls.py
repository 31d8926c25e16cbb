"""Negative controls on the GPU: default kernels violate the contract and the checkers say so."""
import pytest
import torch
import torch.nn.functional as F

from areal_tik.verify import contract


@pytest.mark.gpu
def test_torch_mm_row_subset_is_reported_as_violation():
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    rep = contract.check_row_subset_invariance(lambda a: a @ w.t(), x, [[0], [1], list(range(7))])
    assert not rep.passed and rep.n_mismatch > 0, rep.summary()


@pytest.mark.gpu
def test_sdpa_prefill_vs_decode_is_reported_as_violation():
    h, L, d = 32, 2048, 128
    q, k, v = (torch.randn(1, h, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    pre = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, -16:]
    dec = torch.cat([F.scaled_dot_product_attention(q[:, :, p:p + 1], k[:, :, :p + 1], v[:, :, :p + 1])
                     for p in range(L - 16, L)], 2)
    rep = contract.check_regime_equality({"prefill": pre, "decode": dec})
    assert not rep.passed and rep.n_mismatch > 0, rep.summary()
