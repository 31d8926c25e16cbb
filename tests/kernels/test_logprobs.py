"""logprobs_from_logits / token_logprobs: fused == unfused bit for bit, row invariance,
chunk-size independence, float64 accuracy, entropy, gradients, errors."""
import pytest
import torch

from areal_tik.verify import contract
from areal_tik.kernels import linear as L, logprobs as LP
from areal_tik.kernels.logprobs import layout, torch_ref, triton_ops

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
VB = LP.V_BLOCK


def _impls(impl):
    if impl == "triton":
        return L.linear_triton, LP.logprobs_from_logits_triton, LP.token_logprobs_triton
    return L.linear_torch, LP.logprobs_from_logits_torch, LP.token_logprobs_torch


def _problem(T, V, K, dtype=torch.bfloat16):
    h = torch.randn(T, K, device=DEV).to(dtype)
    w = (torch.randn(V, K, device=DEV) * 2 * K ** -0.5).to(dtype)
    tok = torch.randint(0, V, (T,), device=DEV)
    return h, w, tok


@pytest.mark.parametrize("impl", ["triton", "torch_ref"])
def test_fused_equals_unfused_bitwise_any_chunking(impl, seed_rng):
    lin, lfl, tlp = _impls(impl)
    T, V, K = 9, 2 * VB + 300, 64  # two full blocks + a partial one
    h, w, tok = _problem(T, V, K)
    temp = 0.7
    lp_u, ent_u = lfl(lin(h, w), tok, temp, return_entropy=True)
    for chunk in (None, VB, 2 * VB):
        lp_f, ent_f = tlp(h, w, tok, temp, return_entropy=True, _chunk_cols=chunk)
        assert contract.compare_bits(lp_f, lp_u, name=f"logp chunk={chunk}"), chunk
        assert contract.compare_bits(ent_f, ent_u, name=f"entropy chunk={chunk}"), chunk
    assert contract.compare_bits(tlp(h, w, tok, temp), lp_u)  # entropy off: same logp bits
    ref_lp, ref_ent = LP.logprobs_reference(lin(h, w), tok, temp)
    assert (lp_u.double() - ref_lp).abs().max() < 1e-4
    assert (ent_u.double() - ref_ent).abs().max() < 1e-4


@pytest.mark.parametrize("impl", ["triton", "torch_ref"])
def test_row_subset_invariance(impl, seed_rng):
    lin, lfl, tlp = _impls(impl)
    T, V, K = 19, VB + 77, 64
    h, w, tok = _problem(T, V, K)
    full = tlp(h, w, tok, 1.0, _chunk_cols=VB)
    g = torch.Generator().manual_seed(seed_rng)
    for idx in ([0], [T - 1], [3, 4], torch.randperm(T, generator=g)[:7].tolist()):
        i = torch.tensor(idx, device=DEV)
        assert contract.compare_bits(tlp(h[i], w, tok[i], 1.0, _chunk_cols=VB), full[i]), idx
    logits = lin(h, w)
    rep = contract.check_row_subset_invariance(lambda a: lfl(a, tok[:a.shape[0]] * 0 + 5, 1.3), logits,
                                               [[0], [2, 5, 11], list(range(7))])
    assert rep, rep.summary()


def test_unaligned_logits_and_fp32_logits(seed_rng):
    """A logits view with an odd row stride goes through an aligned copy: same bits."""
    T, V = 6, 1000
    big = torch.randn(T, V + 3, device=DEV).bfloat16()
    view = big[:, 1:V + 1]
    tok = torch.randint(0, V, (T,), device=DEV)
    a = LP.logprobs_from_logits_triton(view, tok, 1.0)
    b = LP.logprobs_from_logits_triton(view.contiguous(), tok, 1.0)
    assert contract.compare_bits(a, b)
    f = torch.randn(T, V, device=DEV) * 10
    lp = LP.logprobs_from_logits_triton(f, tok, 2.0)
    assert (lp.double() - LP.logprobs_reference(f, tok, 2.0)[0]).abs().max() < 1e-4


def test_alignment_decision_logic():
    """The LSE kernel promises ``row * stride`` is a multiple of ROW_ALIGN elements and a
    16-byte aligned base (vector loads). The H200 crashed ("misaligned address") when the
    fused path handed it a [T, 32003] buffer. The decision logic is pure Python: check it."""
    assert layout.ROW_ALIGN == 8
    for V in (1, 7, 300, 2047, 2049, 32003, 32000, 151936, 151937):
        s = layout.padded_row_stride(V)
        assert s >= V and s % layout.ROW_ALIGN == 0 and s % 64 == 0, (V, s)
        buf = layout.alloc_logits_buffer(3, V, torch.bfloat16, "cpu")
        assert buf.shape == (3, V) and buf.stride(0) == s and layout.is_aligned(buf)
    assert not layout.lse_alignment_ok(0, 32003, 2)      # the crashing case
    assert layout.lse_alignment_ok(0, 32003, 1)          # one row: stride never used
    assert not layout.lse_alignment_ok(2, 64, 1)         # base not 16-byte aligned
    assert layout.lse_alignment_ok(32, 4096, 1000)


def test_lse_launch_refuses_unaligned_views(seed_rng):
    T, V = 4, 300
    big = torch.randn(T, V + 1, device=DEV).bfloat16()
    tok = torch.randint(0, V, (T,), device=DEV)
    st, lp, ent = layout.init_state(T, big.device), torch.empty(T, device=DEV), torch.empty(T, device=DEV)
    with pytest.raises(ValueError, match="aligned"):
        triton_ops._lse_launch(big[:, :V], tok, st, lp, ent, 0, V, 1.0, True)   # row stride 301
    with pytest.raises(ValueError, match="aligned"):
        triton_ops._lse_launch(big.view(-1)[1:1 + T * V].view(T, V), tok, st, lp, ent, 0, V, 1.0, True)  # base +2 B


@pytest.mark.parametrize("V", [VB + 3, 2 * VB - 1])
def test_odd_vocab_buffers_aligned_and_bitwise(V, seed_rng, monkeypatch):
    """Odd vocab sizes: every buffer the fused path hands the LSE kernel is aligned (the
    kernel would refuse it otherwise), and fused == unfused bit for bit for any chunking."""
    T, K = 6, 32
    h, w, tok = _problem(T, V, K)
    seen = []
    real = triton_ops._lse_launch

    def spy(lg, *a, **k):
        seen.append((lg.data_ptr() % 16, lg.stride(0), lg.shape[0]))
        return real(lg, *a, **k)
    monkeypatch.setattr(triton_ops, "_lse_launch", spy)
    lp_u = LP.logprobs_from_logits_triton(L.linear_triton(h, w), tok, 0.9)
    for chunk in (None, VB):
        assert contract.compare_bits(LP.token_logprobs_triton(h, w, tok, 0.9, _chunk_cols=chunk), lp_u), chunk
    assert seen and all(layout.lse_alignment_ok(p, s, n) for p, s, n in seen), seen


@pytest.mark.parametrize("impl", ["triton", "torch_ref"])
def test_gradients_hidden_weight_and_logits(impl, seed_rng):
    lin, lfl, tlp = _impls(impl)
    T, V, K = 5, VB + 40, 32
    h, w, tok = _problem(T, V, K, torch.float32)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    a, b = torch.randn(T, device=DEV), torch.randn(T, device=DEV)
    lp, ent = tlp(hg, wg, tok, 0.8, return_entropy=True, _chunk_cols=VB)
    ((lp * a).sum() + (ent * b).sum()).backward()
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    rlp, rent = LP.logprobs_reference(hd @ wd.t(), tok, 0.8)
    ((rlp * a.double()).sum() + (rent * b.double()).sum()).backward()
    assert contract.check_accuracy(hg.grad, hd.grad, 1e-4)
    assert contract.check_accuracy(wg.grad, wd.grad, 1e-4)
    logits = (h @ w.t()).requires_grad_()
    (lfl(logits, tok, 0.8) * a).sum().backward()
    ld = (h @ w.t()).double().requires_grad_()
    (LP.logprobs_reference(ld, tok, 0.8)[0] * a.double()).sum().backward()
    assert contract.check_accuracy(logits.grad, ld.grad, 1e-4)


def test_outputs_written_and_errors(seed_rng):
    T, V = 4, 300
    logits = layout.alloc_logits_buffer(T, V, torch.bfloat16, DEV)  # aligned row stride (the kernel needs it)
    logits.copy_(torch.randn(T, V, device=DEV))
    tok = torch.randint(0, V, (T,), device=DEV)
    st = layout.init_state(T, logits.device)
    lp, ent = torch.empty(T, device=DEV), torch.empty(T, device=DEV)
    assert contract.check_outputs_written(lambda o: triton_ops._lse_launch(logits, tok, st.clone(), o, ent, 0, V, 1.0, True), lp)
    assert contract.check_outputs_written(lambda o: triton_ops._lse_launch(logits, tok, st.clone(), lp, o, 0, V, 1.0, True), ent)
    ref_lp, ref_ent = LP.logprobs_reference(logits, tok, 1.0)
    assert (lp.double() - ref_lp).abs().max() < 1e-4 and (ent.double() - ref_ent).abs().max() < 1e-4
    assert contract.check_inputs_unchanged(lambda a, b: LP.logprobs_from_logits_triton(a, b, 1.0), logits, tok)
    with pytest.raises(ValueError):
        LP.logprobs_from_logits_triton(logits, tok, 0.0)
    with pytest.raises(TypeError):
        LP.logprobs_from_logits_triton(logits, tok.float(), 1.0)
    with pytest.raises(ValueError):
        LP.logprobs_from_logits_triton(logits, tok[:2], 1.0)
    with pytest.raises(ValueError):
        LP.token_logprobs_triton(torch.randn(T, 8).bfloat16(), torch.randn(V, 9).bfloat16(), tok, 1.0)
    with pytest.raises(ValueError):
        LP.token_logprobs_triton(torch.randn(T, 8).bfloat16(), torch.randn(V, 8).bfloat16(), tok, 1.0,
                                 _chunk_cols=100)
    if not ON_GPU:
        with pytest.raises(ValueError):
            LP.logprobs_from_logits_triton(logits, torch.tensor([0, 1, 2, V]), 1.0)


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("V", [151936, 32003])
def test_gpu_fused_equals_unfused_real_vocab(V, seed_rng):
    K = 1536
    h, w, tok = _problem(2048, V, K)
    for T in (1, 7, 64, 1000, 2048):
        lp_u, ent_u = LP.logprobs_from_logits_triton(L.linear_triton(h[:T], w), tok[:T], 0.9, return_entropy=True)
        for chunk in (None, 8 * VB):
            lp_f, ent_f = LP.token_logprobs_triton(h[:T], w, tok[:T], 0.9, return_entropy=True, _chunk_cols=chunk)
            assert contract.compare_bits(lp_f, lp_u, name=f"T={T} chunk={chunk}")
            assert contract.compare_bits(ent_f, ent_u, name=f"ent T={T} chunk={chunk}")
        full = LP.token_logprobs_triton(h, w, tok, 0.9)
        assert contract.compare_bits(lp_u, full[:T], name=f"rows of T=2048 vs T={T}")
    ref = LP.logprobs_reference(L.linear_triton(h, w), tok, 0.9)[0]
    assert (full.double() - ref).abs().max() < 1e-3


@pytest.mark.gpu
def test_gpu_token_logprobs_backward(seed_rng):
    h, w, tok = _problem(512, 151936, 1536)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    a = torch.randn(512, device=DEV)
    (LP.token_logprobs_triton(hg, wg, tok, 1.0) * a).sum().backward()
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    (LP.logprobs_reference(hd @ wd.t(), tok, 1.0)[0] * a.double()).sum().backward()
    assert contract.check_accuracy(hg.grad, hd.grad, 2e-2) and contract.check_accuracy(wg.grad, wd.grad, 2e-2)


def test_logits_backward_row_blocked(seed_rng, monkeypatch):
    """The torch_ref logits-path backward is written block of rows by block of rows (bounded fp32
    temporaries): a 2-row blocking over 7 rows (ragged last block) gives the same gradient bits as
    one block, and the gradient buffer carries the logits' dtype."""
    _, lfl, _ = _impls("torch_ref")
    T, V = 7, 300
    logits = torch.randn(T, V, device=DEV).bfloat16()
    tok = torch.randint(0, V, (T,), device=DEV)
    a, b = torch.randn(T, device=DEV), torch.randn(T, device=DEV)

    def grad():
        lg = logits.clone().requires_grad_()
        lp, ent = lfl(lg, tok, 0.7, return_entropy=True)
        ((lp * a).sum() + (ent * b).sum()).backward()
        return lg.grad

    whole = grad()
    monkeypatch.setattr(torch_ref, "_DLOGITS_ROW_BLOCK", 2)
    blocked = grad()
    assert blocked.dtype == torch.bfloat16 and torch.isfinite(blocked.float()).all()
    assert torch.equal(blocked, whole)


def test_logits_backward_triton_padded_rows(seed_rng):
    """Triton logits-path backward (the token path's in-place kernel on a contiguous copy) on logits
    living in a row-padded buffer (stride > V): same gradient as torch_ref within fp32 noise, the
    logits themselves untouched."""
    T, V = 5, 301
    logits = layout.alloc_logits_buffer(T, V, torch.float32, DEV)
    assert logits.stride(0) > V
    logits.copy_(torch.randn(T, V, device=DEV))
    keep = logits.clone()
    tok = torch.randint(0, V, (T,), device=DEV)
    a, b = torch.randn(T, device=DEV), torch.randn(T, device=DEV)
    grads = []
    for f in (LP.logprobs_from_logits_triton, LP.logprobs_from_logits_torch):
        lg = logits.detach().requires_grad_()
        lp, ent = f(lg, tok, 0.8, return_entropy=True)
        ((lp * a).sum() + (ent * b).sum()).backward()
        grads.append(lg.grad)
    assert torch.equal(logits, keep)
    assert grads[0].shape == (T, V) and (grads[0] - grads[1]).abs().max() < 1e-5


@pytest.mark.parametrize("loss", ["lp_sum", "ent_mean", "both_expanded"])
def test_logits_backward_broadcast_grads(loss, seed_rng):
    """lp.sum() / ent.mean() hand the backward stride-0 (expanded) gradients: the Triton path
    must give torch_ref's gradient (it once read the grad as if contiguous)."""
    T, V = 6, 300
    logits = torch.randn(T, V, device=DEV)
    tok = torch.randint(0, V, (T,), device=DEV)
    grads = []
    for f in (LP.logprobs_from_logits_triton, LP.logprobs_from_logits_torch):
        lg = logits.clone().requires_grad_()
        lp, ent = f(lg, tok, 0.9, return_entropy=True)
        {"lp_sum": lambda: lp.sum(), "ent_mean": lambda: ent.mean(),
         "both_expanded": lambda: lp.sum() + 2 * ent.sum()}[loss]().backward()
        grads.append(lg.grad)
    assert (grads[0] - grads[1]).abs().max() < 1e-5
    assert grads[1].abs().sum() > 0
