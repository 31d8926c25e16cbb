"""``kernels/attention/checks.py`` is the one argument-check module of the attention pair: the csrc wrappers
validate through it like the Triton, fa3 and torch_ref ones, so the same mistake gets the same message."""
import pytest
import torch


def test_every_backend_checks_arguments_through_one_module(monkeypatch):
    """The csrc wrappers validate through ``kernels/attention/checks.py`` like the Triton and torch_ref ones: the
    same mistake gets the same message (the CUDA-device check, which runs first, is stood in for on a CPU)."""
    from areal_tik.kernels.attention.torch_ref import attention_paged_torch, attention_varlen_torch
    from areal_tik.kernels.cuda import attention as CU
    monkeypatch.setattr(CU, "need_cuda", lambda *a: None)
    x, cu = torch.randn(4, 2, 64).bfloat16(), torch.tensor([0, 4], dtype=torch.int32)
    kc, bt, sk = torch.zeros(2, 16, 2, 64).bfloat16(), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([4, 4], dtype=torch.int32)
    bad = [(attention_varlen_torch, CU.attention_varlen_cuda, (torch.randn(4, 2, 96).bfloat16(),) * 3 + (cu, 4), {}),
           (attention_varlen_torch, CU.attention_varlen_cuda, (x, x[:3], x, cu, 4), {}),
           (attention_varlen_torch, CU.attention_varlen_cuda, (x, x, x, cu, 4), {"scale": -1.0}),
           (attention_paged_torch, CU.attention_paged_cuda, (x, kc, kc, bt, cu, sk, 4), {})]
    for ref, cuda, args, kw in bad:
        with pytest.raises((ValueError, TypeError)) as want:
            ref(*args, **kw)
        with pytest.raises(type(want.value)) as got:
            cuda(*args, **kw)
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="contiguous"):   # csrc reads the caches by raw strides
        CU.attention_paged_cuda(x, kc.transpose(0, 1).contiguous().transpose(0, 1), kc, bt, cu, sk[:1], 4)
