"""CUDA C++ attention's backward on the GPU (``-m gpu``): gradients of the varlen forward against float64
autograd with either backward kernel, the backward's selection and determinism, and the forward's optional lse."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from areal_tik.kernels.attention import attention_reference
from areal_tik.kernels.cuda import extension as cuda_extension
from areal_tik.verify.contract import check_accuracy, compare_bits

sys.path.insert(0, os.path.dirname(__file__))
from cuda_helpers import attn  # noqa: E402  (tests/kernels/cuda_helpers.py)


# (lens, Hq, Hkv, D, prefill_kernel, mode): the mma.sync prefill at D 64 and 128, the sm_90a wgmma prefill
# (D 128, auto), a decode-shaped varlen launch (max_seqlen * G <= 16: the decode kernel), and a forced split
# launch (no lse there: the float32 PyTorch recompute backward).
_BWD_CASES = [([70, 1, 130], 8, 2, 64, "auto", "auto"), ([300, 5, 700], 32, 8, 128, "auto", "auto"),
              ([300, 5, 700], 32, 8, 128, "mma", "auto"), ([3, 2, 4], 8, 2, 128, "auto", "auto"),
              ([70, 1, 130], 8, 2, 64, "auto", "split")]


@pytest.mark.gpu
@pytest.mark.parametrize("bwd", ["flash", "triton"])
@pytest.mark.parametrize("case", range(len(_BWD_CASES)))
def test_attention_varlen_backward(case, bwd, seed_rng, monkeypatch):
    """Gradients of the CUDA varlen forward (either backward kernel on the lse the forward writes; float32
    recompute under a forced split) against the float64 reference; the forward's bits do not change
    when autograd asks for the lse."""
    from areal_tik.kernels.attention import flash_backward as attention_backward
    monkeypatch.setattr(attention_backward, "ATTN_BACKWARD", bwd)
    lens, Hq, Hkv, D, pk, mode = _BWD_CASES[case]
    cu = attn()
    g = torch.Generator().manual_seed(seed_rng)
    T = sum(lens)
    q = torch.randn(T, Hq, D, generator=g).bfloat16().cuda().requires_grad_(True)
    k = torch.randn(T, Hkv, D, generator=g).bfloat16().cuda().requires_grad_(True)
    v = torch.randn(T, Hkv, D, generator=g).bfloat16().cuda().requires_grad_(True)
    cus = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    out = cu.attention_varlen_cuda(q, k, v, cus, max(lens), mode=mode, prefill_kernel=pk)
    with torch.no_grad():
        rep = compare_bits(out, cu.attention_varlen_cuda(q, k, v, cus, max(lens), mode=mode, prefill_kernel=pk))
        assert rep, rep
    do = torch.randn(out.shape, generator=g).bfloat16().cuda()
    grads = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = attention_reference(qd, kd, vd, cus)
    rgrads = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    for name, a, r in zip("qkv", grads, rgrads):
        rep = check_accuracy(a, r, 2e-2, name=f"d{name}")
        assert rep, rep


@pytest.mark.gpu
def test_attention_backward_selection_and_determinism(seed_rng):
    """auto takes PyTorch's flash backward on an H100/H200-class GPU, and the Triton backward under
    torch.use_deterministic_algorithms, whose gradients are then the same bits on every run; both are the
    same gradient (float64 reference within 2e-2; each other within 1e-2)."""
    from areal_tik.kernels.attention import flash_backward as ab
    cu = attn()
    g = torch.Generator().manual_seed(seed_rng)
    lens, Hq, Hkv, D = [600, 3, 1000], 12, 2, 128
    T = sum(lens)
    q, k, v = (torch.randn(T, h, D, generator=g).bfloat16().cuda().requires_grad_(True) for h in (Hq, Hkv, Hkv))
    cus = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    do = torch.randn(T, Hq, D, generator=g).bfloat16().cuda()
    assert ab.select_backward(q, k, "auto") == "flash"
    runs = {}
    prev = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert ab.select_backward(q, k, "auto") == "triton"
        runs["triton"] = [torch.autograd.grad(cu.attention_varlen_cuda(q, k, v, cus, max(lens)), (q, k, v), do)
                          for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(prev)
    for a, b in zip(*runs["triton"]):
        assert torch.equal(a, b)
    fl = torch.autograd.grad(cu.attention_varlen_cuda(q, k, v, cus, max(lens)), (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    rgrads = torch.autograd.grad(attention_reference(qd, kd, vd, cus), (qd, kd, vd), do.double())
    for name, a, b, r in zip("qkv", fl, runs["triton"][0], rgrads):
        assert check_accuracy(a, r, 2e-2, name=f"flash d{name}") and check_accuracy(b, r, 2e-2, name=f"triton d{name}")
        assert check_accuracy(a, b.double(), 1e-2, name=f"flash vs triton d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("pk", ["auto", "mma"])
def test_attention_varlen_lse(pk, seed_rng):
    """The forward's optional lse: each row's base-2 log-sum-exp of its scaled causal scores (float64
    reference within 1e-4 relative), rows outside cu_seqlens untouched, output bits unchanged, refused
    with a forced split mode."""
    ext = cuda_extension.extension()
    g = torch.Generator().manual_seed(seed_rng)
    lens, Hq, Hkv, D = [257, 1, 64, 600], 16, 4, 128
    T = sum(lens)
    q, k, v = (torch.randn(T + 3, h, D, generator=g).bfloat16().cuda() for h in (Hq, Hkv, Hkv))
    cus = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    sc = D ** -0.5
    pkc = {"auto": 0, "mma": 1}[pk]
    lse = torch.full((T + 3, Hq), float("nan"), device="cuda")
    out = ext.attention_varlen_fwd(q, k, v, cus, max(lens), sc, 0, prefill_kernel=pkc, lse=lse)
    plain = ext.attention_varlen_fwd(q, k, v, cus, max(lens), sc, 0, prefill_kernel=pkc)
    rep = compare_bits(plain[:T], out[:T], name="output with lse == without")
    assert rep, rep
    assert torch.isnan(lse[T:]).all(), "rows outside cu_seqlens were written"
    ref = torch.empty(T, Hq, dtype=torch.float64)
    G = Hq // Hkv
    for i, L in enumerate(lens):
        a = int(cus[i])
        s = torch.einsum("qhd,khd->hqk", q[a:a + L].double().cpu(),
                         k[a:a + L].double().cpu().repeat_interleave(G, 1)) * sc
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        ref[a:a + L] = (torch.logsumexp(s, -1) / math.log(2)).transpose(0, 1)
    err = ((lse[:T].double().cpu() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
    assert err < 1e-4, f"lse max relative error {err:.3g}"
    with pytest.raises(RuntimeError, match="lse"):
        ext.attention_varlen_fwd(q, k, v, cus, max(lens), sc, 2, lse=lse)
