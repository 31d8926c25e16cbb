"""moe_route: a token's experts and weights are the same bits alone and in any batch; ties go to the lower
expert index; a non-finite row gets valid ids (E - 1); accurate against the float64 reference; backward matches
the reference's gradient."""
import pytest
import torch

from areal_tik.kernels import moe
from moe_helpers import BACKENDS, ROUTE, poisoned_empty  # noqa: F401  (fixture)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm", [True, False])
def test_token_alone_equals_in_any_batch(backend, norm, seed_rng, poisoned_empty):  # noqa: F811
    route = ROUTE[backend]
    logits = torch.randn(37, 16).bfloat16()
    w, ids = route(logits, 4, norm)
    assert not torch.isnan(w).any() and (ids >= 0).all()
    perm = torch.randperm(37)
    wp, idp = route(logits[perm].contiguous(), 4, norm)
    assert torch.equal(wp, w[perm]) and torch.equal(idp, ids[perm])
    for t in (0, 17, 36):
        w1, i1 = route(logits[t:t + 1].contiguous(), 4, norm)
        assert torch.equal(w1, w[t:t + 1]) and torch.equal(i1, ids[t:t + 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_go_to_the_lower_expert_index(backend):
    route = ROUTE[backend]
    E = 8
    rows = torch.full((4, E), -1.0)
    rows[1] = 0.0                                # every expert ties: experts 0, 1, 2
    rows[2, [6, 3]] = 2.0                        # a tie for first place: 3 before 6
    rows[3, 5] = 3.0                             # a unique first, then a tie for second between 7, 4 and 1
    rows[3, [7, 4, 1]] = 1.0
    w, ids = route(rows.bfloat16(), 3, False)
    assert ids[1].tolist() == [0, 1, 2]
    assert ids[2].tolist()[:2] == [3, 6] and torch.equal(w[2, 0], w[2, 1])
    assert ids[3].tolist() == [5, 1, 4]
    assert ids[0].tolist() == [0, 1, 2]          # all -1: the lowest indices
    # the float64 reference (a stable descending sort) agrees
    assert torch.equal(moe.route_reference(rows.bfloat16(), 3, False)[1], ids)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("E", [8, 12])
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")     # the NaN row's arithmetic in the interpreter
def test_non_finite_rows_get_the_last_expert(backend, E, seed_rng):
    """A row with a NaN or an inf logit (a CUDA graph's padding row) gets expert E - 1 at every rank, never an id
    past E; the finite rows beside it keep their bits."""
    logits = torch.randn(6, E).bfloat16()
    bad = logits.clone()
    bad[1, 3], bad[4, 0], bad[5] = float("nan"), float("inf"), float("nan")
    w, ids = ROUTE[backend](bad, 3, True)
    w0, ids0 = ROUTE[backend](logits, 3, True)
    for t in (1, 4, 5):
        assert ids[t].tolist() == [E - 1] * 3              # (its weights are meaningless: NaN, or not)
    ok = [0, 2, 3]
    assert torch.equal(ids[ok], ids0[ok]) and torch.equal(w[ok], w0[ok])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm", [True, False])
def test_accurate_against_reference(backend, norm, seed_rng):
    logits = (torch.randn(64, 32) * 2).bfloat16()
    w, ids = ROUTE[backend](logits, 8, norm)
    rw, rids = moe.route_reference(logits, 8, norm)
    assert torch.equal(ids, rids)
    assert ((w.double() - rw).abs() / rw).max() < 1e-6
    if norm:
        assert torch.allclose(w.double().sum(-1), torch.ones(64, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm", [True, False])
def test_backward_matches_reference_gradient(backend, norm, seed_rng):
    logits = torch.randn(12, 8, dtype=torch.float32, requires_grad=True)
    w, ids = ROUTE[backend](logits, 3, norm)
    dw = torch.randn_like(w)
    (w * dw).sum().backward()
    ref_logits = logits.detach().double().requires_grad_()
    rw, rids = moe.route_reference(ref_logits, 3, norm)
    assert torch.equal(ids, rids)
    (rw * dw.double()).sum().backward()
    assert torch.allclose(logits.grad.double(), ref_logits.grad, rtol=1e-5, atol=1e-7)
    g1 = logits.grad.clone()                      # deterministic: the same gradient again
    logits.grad = None
    w, _ = ROUTE[backend](logits, 3, norm)
    (w * dw).sum().backward()
    assert torch.equal(logits.grad, g1)


def test_refuses_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        moe.route_torch(torch.randn(2, 4).bfloat16(), 5, True)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        moe.route_torch(torch.randn(2, 4, 1).bfloat16(), 1, True)
    with pytest.raises(TypeError, match="dtype"):
        moe.route_torch(torch.randn(2, 4).double(), 1, True)
