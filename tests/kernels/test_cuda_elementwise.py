"""CUDA C++ elementwise ops on the GPU (``-m gpu``): kv_cache_write exactness and -1 skipping; RMSNorm row-subset
invariance, strided input, float64 bound; RoPE bits equal to the unfused fp32 PyTorch expression, float64 bound;
backward passes against float64 autograd."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from areal_tik.kernels.cuda import elementwise as cuda_elementwise, extension as cuda_extension
from areal_tik.kernels.rms_norm import rms_norm_reference
from areal_tik.kernels.rope import apply_rope_reference, rope_table
from areal_tik.verify.contract import check_accuracy, check_row_subset_invariance, compare_bits, poison_

sys.path.insert(0, os.path.dirname(__file__))
from cuda_helpers import written  # noqa: E402  (tests/kernels/cuda_helpers.py)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,slot_dtype", [(torch.bfloat16, torch.int64), (torch.float32, torch.int32)])
def test_kv_cache_write_exact(dtype, slot_dtype):
    T, H, D, P, ps = 50, 4, 64, 8, 16
    k = torch.randn(T, H, D, device="cuda").to(dtype)
    v = torch.randn(T, H, D, device="cuda").to(dtype)
    slots = torch.randperm(P * ps, device="cuda")[:T]
    slots[::7] = -1
    kc = poison_(torch.empty(P, ps, H, D, dtype=dtype, device="cuda"))
    vc = poison_(torch.empty_like(kc))
    ek, ev = kc.clone(), vc.clone()
    keep = slots >= 0
    ek.view(-1, H, D)[slots[keep]] = k[keep]
    ev.view(-1, H, D)[slots[keep]] = v[keep]
    cuda_elementwise.kv_cache_write_cuda(k, v, kc, vc, slots.to(slot_dtype))
    assert compare_bits(kc, ek) and compare_bits(vc, ev)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N", [(1, 128), (7, 1536), (300, 4096), (33, 123), (5, 8192), (64, 3584)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_row_invariance_and_accuracy(M, N, dtype, seed_rng):
    g = torch.Generator().manual_seed(seed_rng)
    x = (torch.randn(M, N, generator=g) * 3).to(dtype).cuda()
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype).cuda()
    eps = 1e-6
    fn = lambda t: cuda_elementwise.rms_norm_cuda(t, w, eps)  # noqa: E731
    subsets = [[0], [M - 1], torch.randperm(M, generator=g)[: max(1, M // 2)].tolist()]
    rep = check_row_subset_invariance(fn, x, subsets)
    assert rep, rep
    y = written(lambda o: cuda_elementwise.rms_norm_cuda(x, w, eps, out=o), x.shape, dtype)
    assert compare_bits(y, fn(x))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    acc = check_accuracy(y, rms_norm_reference(x, w, eps), tol)
    assert acc, acc
    # strided rows (a view into a wider buffer) and a 3-D input give the same bits
    wide = torch.zeros(M, N + 40, dtype=dtype, device="cuda")
    wide[:, 7:7 + N] = x
    assert compare_bits(cuda_elementwise.rms_norm_cuda(wide[:, 7:7 + N], w, eps), y)
    if M % 3 == 0:
        assert compare_bits(cuda_elementwise.rms_norm_cuda(x.view(3, M // 3, N), w, eps).view(M, N), y)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(9, 256), (2, 5000, 1536)])  # (2, 5000, 1536): 3-D, 16 rows per program
def test_rms_norm_backward(shape, seed_rng):
    n = shape[-1]
    x = torch.randn(*shape, device="cuda").bfloat16().requires_grad_(True)
    w = (1 + 0.1 * torch.randn(n, device="cuda")).bfloat16().requires_grad_(True)
    y = cuda_elementwise.rms_norm_cuda(x, w, 1e-6)
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    assert gx.shape == x.shape and gw.shape == w.shape and gx.dtype == gw.dtype == torch.bfloat16
    xd, wd = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    rx, rw = torch.autograd.grad(rms_norm_reference(xd, wd, 1e-6), (xd, wd), dy.double())
    assert check_accuracy(gx, rx, 2e-2) and check_accuracy(gw, rw, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D,H", [(64, 6), (128, 6), (128, 40)])  # 40 x 128: a token's 320 groups over 2 CTAs
def test_apply_rope_bits_invariance_accuracy(dtype, D, H, seed_rng):
    g = torch.Generator().manual_seed(seed_rng)
    T, P = 77, 4096
    cos, sin = rope_table(D, P, 1e6, device="cuda")
    qkv = torch.randn(T, 3 * H, D, generator=g).to(dtype).cuda()
    x = qkv[:, H:2 * H]  # strided view, as from a fused qkv projection
    positions = torch.randint(0, P, (T,), generator=g).cuda()
    y = written(lambda o: cuda_elementwise.apply_rope_cuda(x, cos, sin, positions, out=o), x.shape, dtype)
    # the unfused fp32 expression x*cos + rotate_half(x)*sin, rounded once
    h = D // 2
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    xf = x.float()
    expect = torch.cat([xf[..., :h] * c[..., :h] - xf[..., h:] * s[..., :h],
                        xf[..., h:] * c[..., h:] + xf[..., :h] * s[..., h:]], -1).to(dtype)
    rep = compare_bits(y, expect, name="rope==torch fp32 unfused")
    assert rep, rep
    sub = torch.tensor([3, 0, 50], device="cuda")
    assert compare_bits(cuda_elementwise.apply_rope_cuda(x[sub], cos, sin, positions[sub].int()), y[sub])
    # a base 2 bytes past a 16-byte boundary: the element path, the same bits as the vector path
    shifted = torch.empty(T * H * D + 1, dtype=dtype, device="cuda")[1:].view(T, H, D)
    shifted.copy_(x)
    assert compare_bits(cuda_elementwise.apply_rope_cuda(shifted, cos, sin, positions), y)
    acc = check_accuracy(y, apply_rope_reference(x, cos, sin, positions), 1e-5 if dtype == torch.float32 else 1e-2)
    assert acc, acc


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_rope_backward_transpose_bits(dtype, seed_rng):
    """The csrc backward is the transpose with fp32 products and sum rounded separately: the unfused torch
    expression's bits, on both the vector path (aligned bf16) and the element path (shifted base)."""
    g = torch.Generator().manual_seed(seed_rng)
    T, H, D, P = 50, 12, 128, 2048
    cos, sin = rope_table(D, P, 1e6, device="cuda")
    dy = torch.randn(T, H, D, generator=g).to(dtype).cuda()
    pos = torch.randint(0, P, (T,), generator=g).cuda()
    h = D // 2
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    gf = dy.float()
    expect = torch.cat([gf[..., :h] * c[..., :h] + gf[..., h:] * s[..., h:],
                        gf[..., h:] * c[..., h:] - gf[..., :h] * s[..., :h]], -1).to(dtype)
    out = torch.full_like(dy, float("nan"))
    got = cuda_extension.extension().apply_rope_fwd(dy, cos, sin, pos, out=out, backward=True)
    assert got.data_ptr() == out.data_ptr()
    rep = compare_bits(got, expect, name="rope backward==torch fp32 unfused")
    assert rep, rep
    shifted = torch.empty(T * H * D + 1, dtype=dtype, device="cuda")[1:].view(T, H, D)
    shifted.copy_(dy)
    assert compare_bits(cuda_extension.extension().apply_rope_fwd(shifted, cos, sin, pos, backward=True), expect)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D,H", [(torch.float32, 64, 3), (torch.bfloat16, 128, 12)])
def test_apply_rope_backward(dtype, D, H):
    T = 20
    cos, sin = rope_table(D, 128, 1e6, device="cuda")
    x = torch.randn(T, H, D, device="cuda").to(dtype).requires_grad_(True)
    pos = torch.randint(0, 128, (T,), device="cuda")
    y = cuda_elementwise.apply_rope_cuda(x, cos, sin, pos)
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, (x,), dy)
    xd = x.detach().double().requires_grad_(True)
    (rx,) = torch.autograd.grad(apply_rope_reference(xd, cos, sin, pos), (xd,), dy.double())
    assert gx.dtype == dtype and check_accuracy(gx, rx, 1e-5 if dtype == torch.float32 else 1e-2)
