"""``qk_norm_rope``: the per-head q/k norms and RoPE in one launch give the bits of ``rms_norm`` then
``apply_rope`` on each (triton: the Triton ops apart; torch_ref: the torch_ref ops apart), on strided views of a
stacked q/k/v output and on fresh random rows; a token's rows do not depend on the batch; poisoned outputs are
written; gradients match the composition; bad arguments fail in one line. CPU interpreter at tiny shapes, the
GPU at the model shapes (where the compiler's reductions and contractions are what is being checked)."""
import pytest
import torch

from areal_tik.kernels import qk_norm_rope as QK, rms_norm as R, rope as P
from areal_tik.verify import contract

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
FUSED = {"triton": QK.qk_norm_rope_triton, "torch_ref": QK.qk_norm_rope_torch}
NORM = {"triton": R.rms_norm_triton, "torch_ref": R.rms_norm_torch}
ROPE = {"triton": P.apply_rope_triton, "torch_ref": P.apply_rope_torch}


def _inputs(T, hq, hk, D, dtype, device, seed, max_pos=64):
    """q, k as views of one stacked ``[T, (hq + 2 hk) * D]`` buffer (as the stacked GEMM writes them), weights,
    the table and positions; values fresh from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (hq + 2 * hk) * D, generator=g) * 3).to(dtype).to(device)
    q = qkv[:, : hq * D].reshape(T, hq, D)
    k = qkv[:, hq * D: (hq + hk) * D].reshape(T, hk, D)
    wq = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype).to(device)
    wk = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype).to(device)
    cos, sin = P.rope_table(D, max_pos, 1e6, device=device)
    pos = torch.randint(0, max_pos, (T,), generator=g).to(device)
    return q, k, wq, wk, cos, sin, pos


def _apart(backend, q, k, wq, wk, cos, sin, pos, eps):
    norm, rope = NORM[backend], ROPE[backend]
    if wq is not None:
        q, k = norm(q.contiguous(), wq, eps), norm(k.contiguous(), wk, eps)
    return rope(q, cos, sin, pos), rope(k, cos, sin, pos)


def _check_equals_apart(backend, device, shapes, dtypes, seed0=0):
    for i, dtype in enumerate(dtypes):
        for j, (T, hq, hk, D) in enumerate(shapes):
            q, k, wq, wk, cos, sin, pos = _inputs(T, hq, hk, D, dtype, device, seed0 + 100 * i + j)
            for weights in ((wq, wk), (None, None)):
                qo, ko = FUSED[backend](q, k, cos, sin, pos, *weights, eps=1e-6)
                q0, k0 = _apart(backend, q, k, *weights, cos, sin, pos, 1e-6)
                assert qo.is_contiguous() and ko.is_contiguous()
                assert torch.equal(qo, q0), (backend, dtype, T, hq, hk, D, weights[0] is None)
                assert torch.equal(ko, k0), (backend, dtype, T, hq, hk, D, weights[0] is None)


@pytest.mark.parametrize("backend", ["triton", "torch_ref"])
def test_fused_equals_norm_then_rope(backend):
    _check_equals_apart(backend, "cpu", [(3, 4, 2, 16), (5, 6, 1, 32), (1, 1, 1, 8)],
                        (torch.bfloat16, torch.float32))


@pytest.mark.parametrize("backend", ["triton", "torch_ref"])
def test_token_rows_do_not_depend_on_the_batch(backend, seed_rng):
    q, k, wq, wk, cos, sin, pos = _inputs(9, 6, 2, 16, torch.bfloat16, DEV, int(torch.randint(2**31, ())))
    qo, ko = FUSED[backend](q, k, cos, sin, pos, wq, wk, 1e-6)
    for idx in ([0], [8], [3, 1], [7, 2, 5, 0]):
        i = torch.tensor(idx, device=DEV)
        qs, ks = FUSED[backend](q.index_select(0, i), k.index_select(0, i), cos, sin, pos[i], wq, wk, 1e-6)
        assert torch.equal(qs, qo[i]) and torch.equal(ks, ko[i]), idx


def test_accuracy_against_float64(seed_rng):
    q, k, wq, wk, cos, sin, pos = _inputs(7, 4, 2, 32, torch.bfloat16, DEV, 3)
    qo, ko = QK.qk_norm_rope_triton(q, k, cos, sin, pos, wq, wk, 1e-6)
    qr, kr = QK.qk_norm_rope_reference(q, k, cos, sin, pos, wq, wk, 1e-6)
    assert contract.check_accuracy(qo, qr, 1e-2) and contract.check_accuracy(ko, kr, 1e-2)


def test_outputs_written_everywhere():
    """Poisoned output buffers: every element of both outputs is written."""
    q, k, wq, wk, cos, sin, pos = _inputs(5, 6, 3, 16, torch.bfloat16, DEV, 4)
    qo = torch.empty(5, 6, 16, dtype=torch.bfloat16, device=DEV)
    ko = torch.empty(5, 3, 16, dtype=torch.bfloat16, device=DEV)
    for weights in ((wq, wk), (None, None)):
        assert contract.check_outputs_written(
            lambda o: QK.qk_norm_rope_launch(q, k, *weights, 1e-6, cos, sin, pos, out=(o, ko)), qo)
        assert contract.check_outputs_written(
            lambda o: QK.qk_norm_rope_launch(q, k, *weights, 1e-6, cos, sin, pos, out=(qo, o)), ko)


def test_negative_control_norm_after_rope_differs():
    """RoPE before the norm is not the same function: the equality checks above can fail."""
    q, k, wq, wk, cos, sin, pos = _inputs(4, 4, 2, 16, torch.bfloat16, DEV, 5)
    qo, _ = QK.qk_norm_rope_triton(q, k, cos, sin, pos, wq, wk, 1e-6)
    swapped = R.rms_norm_triton(P.apply_rope_triton(q, cos, sin, pos), wq, 1e-6)
    assert not torch.equal(qo, swapped)


@pytest.mark.parametrize("with_norm", [True, False])
def test_gradients_match_the_composition(with_norm):
    """Backward (fp32): q, k and both weights against autograd through the torch_ref composition."""
    q, k, wq, wk, cos, sin, pos = _inputs(5, 4, 2, 16, torch.float32, DEV, 6)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, wq, wk)]
    ref = [t.detach().clone().requires_grad_(True) for t in (q, k, wq, wk)]
    gq, gk = torch.randn(5, 4, 16, device=DEV), torch.randn(5, 2, 16, device=DEV)

    def run(fn, ts):
        weights = (ts[2], ts[3]) if with_norm else (None, None)
        qo, ko = fn(ts[0], ts[1], cos, sin, pos, *weights, 1e-6)
        ((qo * gq).sum() + (ko * gk).sum()).backward()

    run(QK.qk_norm_rope_triton, leaves)
    run(QK.qk_norm_rope_torch, ref)
    for a, b in zip(leaves, ref):
        if b.grad is None:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_bad_arguments_fail_in_one_line():
    q, k, wq, wk, cos, sin, pos = _inputs(3, 2, 1, 16, torch.bfloat16, "cpu", 7)
    with pytest.raises(ValueError, match="both q_weight and k_weight"):
        QK.qk_norm_rope_triton(q, k, cos, sin, pos, wq, None)
    with pytest.raises(ValueError, match="cos/sin"):          # k's head dim is not the table's
        QK.qk_norm_rope_torch(q, torch.zeros(3, 1, 8, dtype=torch.bfloat16), cos, sin, pos)
    with pytest.raises((ValueError, TypeError)):
        QK.qk_norm_rope_triton(q, k.float(), cos, sin, pos)
    with pytest.raises(ValueError, match="positions"):
        QK.qk_norm_rope_triton(q, k, cos, sin, pos[:2])
    with pytest.raises(ValueError):
        QK.qk_norm_rope_triton(q, k, cos, sin, pos, wq[:8], wk[:8])


@pytest.mark.gpu
def test_gpu_fused_equals_norm_then_rope():
    """The model shapes (Qwen3-8B 32/8 heads, Qwen3-30B-A3B 32/4, a 7B-like 28/4; head dim 128), decode and
    prefill row counts, three dtypes: the fused launch against the two Triton ops apart, bit for bit."""
    if not ON_GPU:
        pytest.skip("needs a GPU")
    _check_equals_apart("triton", "cuda", [(1, 32, 8, 128), (64, 32, 4, 128), (257, 28, 4, 128), (4096, 32, 4, 128),
                                           (33, 16, 2, 64)], (torch.bfloat16, torch.float16, torch.float32))
