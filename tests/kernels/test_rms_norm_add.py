"""``add_rms_norm``: the residual add and the next RMSNorm in one launch give exactly the bits of the add then
``rms_norm`` (both outputs), on fresh random rows, several widths, strided rows; gradients flow to both inputs."""
import pytest
import torch

from areal_tik.kernels import rms_norm as R


def _rows(m, n, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(m, n, generator=g) * 3).to(dtype).to(device)
    r = (torch.randn(m, n, generator=g) * 20).to(dtype).to(device)
    w = (torch.rand(n, generator=g) + 0.5).to(dtype).to(device)
    return x, r, w


def _check_equal(fused, plain, device, dtypes, shapes):
    for i, dtype in enumerate(dtypes):
        for j, (m, n) in enumerate(shapes):
            x, r, w = _rows(m, n, dtype, device, seed=100 * i + j)
            y, s = fused(x, r, w, 1e-6)
            s0 = r + x
            assert torch.equal(s, s0), (dtype, m, n)
            assert torch.equal(y, plain(s0, w, 1e-6)), (dtype, m, n)


@pytest.mark.parametrize("backend", ["triton", "torch_ref"])
def test_fused_equals_add_then_norm(backend):
    fused = {"triton": R.add_rms_norm_triton, "torch_ref": R.add_rms_norm_torch}[backend]
    plain = {"triton": R.rms_norm_triton, "torch_ref": R.rms_norm_torch}[backend]
    _check_equal(fused, plain, "cpu", (torch.bfloat16, torch.float32), [(1, 64), (5, 128), (3, 100)])


def test_strided_rows_and_bad_arguments():
    x, r, w = _rows(6, 64, torch.bfloat16, "cpu", seed=7)
    wide = torch.zeros(6, 96, dtype=torch.bfloat16)
    wide[:, :64] = x
    y, s = R.add_rms_norm_triton(wide[:, :64], r, w, 1e-6)          # a row stride of 96
    assert torch.equal(s, r + x) and torch.equal(y, R.rms_norm_triton(r + x, w, 1e-6))
    with pytest.raises(ValueError, match="residual"):
        R.add_rms_norm_triton(x, r[:, :32], w, 1e-6)
    with pytest.raises((ValueError, TypeError)):
        R.add_rms_norm_triton(x, r.float(), w, 1e-6)


def test_gradients_reach_both_inputs():
    """Backward: the norm's gradient plus the residual stream's, to x and to residual alike (fp32, against
    autograd through the torch composition)."""
    x, r, w = _rows(4, 64, torch.float32, "cpu", seed=3)
    xs = [t.clone().requires_grad_(True) for t in (x, r, w)]
    xt = [t.clone().requires_grad_(True) for t in (x, r, w)]
    gy, gs = torch.randn(4, 64), torch.randn(4, 64)
    y, s = R.add_rms_norm_triton(*xs, 1e-6)
    ((y * gy).sum() + (s * gs).sum()).backward()
    y2, s2 = R.add_rms_norm_torch(*xt, 1e-6)
    ((y2 * gy).sum() + (s2 * gs).sum()).backward()
    for a, b in zip(xs, xt):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    assert torch.equal(xs[0].grad, xs[1].grad)


def test_negative_control_an_fp32_sum_not_rounded_differs():
    """Without the rounding of the sum to bf16 before the norm the outputs differ: the check above can fail."""
    x, r, w = _rows(8, 128, torch.bfloat16, "cpu", seed=11)
    unrounded = R.rms_norm_triton((x.float() + r.float()), w.float(), 1e-6).to(torch.bfloat16)
    assert not torch.equal(unrounded, R.add_rms_norm_triton(x, r, w, 1e-6)[0])


@pytest.mark.gpu
def test_gpu_fused_equals_add_then_norm():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _check_equal(R.add_rms_norm_triton, R.rms_norm_triton, "cuda", (torch.bfloat16, torch.float16, torch.float32),
                 [(1, 1536), (64, 1536), (257, 3584), (4096, 3584), (7, 2048), (3, 5120), (2, 8192)])
