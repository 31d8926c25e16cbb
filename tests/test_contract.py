"""The contract checkers must pass on invariant code and *fail* on non-invariant code."""
import math

import pytest
import torch

from areal_tik.verify import contract


def row_sum_fixed_order(x: torch.Tensor) -> torch.Tensor:
    """Row-wise sum with a fixed sequential order: row-invariant by construction."""
    acc = torch.zeros(x.shape[0], dtype=x.dtype)
    for j in range(x.shape[1]):
        acc = acc + x[:, j]
    return acc


def row_sum_batch_dependent(x: torch.Tensor) -> torch.Tensor:
    """A deliberately order-dependent toy reduction: the summation order of every row
    depends on how many rows are in the batch (like a split-K chosen from M)."""
    m, k = x.shape
    splits = 1 + (m % 4)
    acc = torch.zeros(m, dtype=x.dtype)
    chunk = math.ceil(k / splits)
    for s in range(splits):
        part = torch.zeros(m, dtype=x.dtype)
        for j in range(s * chunk, min(k, (s + 1) * chunk)):
            part = part + x[:, j]
        acc = acc + part
    return acc


def test_compare_bits_reports_counts_and_first_index(seed_rng):
    a = torch.randn(7, 5)
    b = a.clone()
    b[3, 2] = b[3, 2] + 1.0
    b[5, 0] = -b[5, 0]
    rep = contract.compare_bits(a, b)
    assert not rep.passed
    assert rep.n_mismatch == 2 and rep.n_compared == 35
    assert rep.first_mismatch == (3, 2)
    assert rep.max_abs_diff == pytest.approx(max(1.0, 2 * abs(float(a[5, 0]))), rel=1e-6)
    assert contract.compare_bits(a, a.clone()).passed
    with pytest.raises(contract.ContractViolation):
        rep.raise_if_failed()


def test_compare_bits_distinguishes_signed_zero_and_shape():
    assert not contract.compare_bits(torch.tensor([0.0]), torch.tensor([-0.0])).passed
    assert not contract.compare_bits(torch.zeros(2), torch.zeros(3)).passed
    assert not contract.compare_bits(torch.zeros(2), torch.zeros(2, dtype=torch.float64)).passed


def test_row_subset_invariance_passes_fixed_order(seed_rng):
    x = torch.randn(37, 64)
    subsets = [[0], [5, 6, 7], torch.randperm(37)[:13].tolist()]
    rep = contract.check_row_subset_invariance(row_sum_fixed_order, x, subsets)
    assert rep.passed, rep.summary()
    assert rep.n_compared == 1 + 3 + 13


def test_negative_control_order_dependent_reduction_is_caught(seed_rng):
    """Negative control: a batch-size-dependent reduction order must be reported."""
    x = torch.randn(37, 257) * 1e3  # large, varied magnitudes make rounding differences likely
    subsets = [[i] for i in range(10)] + [list(range(2)), list(range(3)), torch.randperm(37)[:6].tolist()]
    rep = contract.check_row_subset_invariance(row_sum_batch_dependent, x, subsets)
    assert not rep.passed
    assert rep.n_mismatch > 0 and rep.max_abs_diff > 0
    assert rep.first_mismatch is not None
    assert "FAIL" in rep.summary()


def _seg_cumsum(packed, cu):
    """Per-sequence running sum: depends only on the sequence's own tokens."""
    out = torch.empty_like(packed)
    for i in range(len(cu) - 1):
        a, b = int(cu[i]), int(cu[i + 1])
        acc = torch.zeros_like(packed[0])
        for t in range(a, b):
            acc = acc + packed[t]
            out[t] = acc
    return out


def _leaky_cumsum(packed, cu):
    """Wrong: ignores sequence boundaries, so neighbours leak in."""
    return torch.cumsum(packed, 0)


def test_packing_invariance_passes_and_catches_leak(seed_rng):
    seqs = [torch.randn(n, 3) for n in (1, 4, 7, 2)]
    good = contract.check_packing_invariance(_seg_cumsum, seqs, n_packings=3, pad_to=8)
    assert good.passed, good.summary()
    bad = contract.check_packing_invariance(_leaky_cumsum, seqs, n_packings=3, pad_to=8)
    assert not bad.passed and bad.n_mismatch > 0


def test_regime_equality_and_accuracy(seed_rng):
    x = torch.randn(16, 8)
    assert contract.check_regime_equality({"a": x, "b": x.clone(), "c": x.clone()}).passed
    y = x.clone()
    y[0, 0] = y[0, 0].nextafter(torch.tensor(math.inf))
    rep = contract.check_regime_equality({"a": x, "b": x.clone(), "c": y})
    assert not rep.passed and rep.n_mismatch == 1
    ref = x.double()
    assert contract.check_accuracy(x.bfloat16(), ref, rtol=1e-2).passed
    assert not contract.check_accuracy(x.bfloat16() * 1.1, ref, rtol=1e-2).passed
    nan = x.clone()
    nan[1, 1] = float("nan")
    rep = contract.check_accuracy(nan, ref, rtol=1.0)
    assert not rep.passed and rep.first_mismatch == (1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_outputs_written_catches_skipped_elements(dtype):
    out = torch.empty(10, 4, dtype=dtype)

    def full(o):
        o.copy_(torch.arange(40).reshape(10, 4).to(dtype))

    def partial(o):
        o[:9].copy_(torch.arange(36).reshape(9, 4).to(dtype))

    assert contract.check_outputs_written(full, out).passed
    rep = contract.check_outputs_written(partial, out)
    assert not rep.passed and rep.n_mismatch == 4 and rep.first_mismatch == (9, 0)


def test_inputs_unchanged_catches_mutation(seed_rng):
    a, b = torch.randn(5), torch.randn(5)
    assert contract.check_inputs_unchanged(lambda x, y: x + y, a, b).passed
    rep = contract.check_inputs_unchanged(lambda x, y: y.mul_(2), a, b)
    assert not rep.passed and rep.n_mismatch == 5


def test_report_round_trips_to_dict():
    rep = contract.compare_bits(torch.zeros(3), torch.ones(3))
    d = rep.to_dict()
    assert d["n_mismatch"] == 3 and d["passed"] is False and d["first_mismatch"] == "(0,)"


def test_nothing_compared_is_a_failure(seed_rng):
    """An empty subset list, zero packings or no inputs must not pass vacuously."""
    x = torch.randn(5, 3)
    assert not contract.check_row_subset_invariance(row_sum_fixed_order, x, []).passed
    assert not contract.check_packing_invariance(_seg_cumsum, [x[:2], x[2:]], n_packings=0).passed
    assert not contract.check_inputs_unchanged(lambda: None).passed


def test_packing_pads_integer_tokens_with_random_ids(seed_rng):
    """Integer token sequences get random padding ids from their own range (not one repeated token)."""
    seqs = [torch.randint(3, 1000, (n,)) for n in (5, 9)]
    seen = []

    def fn(packed, cu):
        seen.append(packed[int(cu[-2]):int(cu[-1])].clone() if len(cu) > 3 else None)
        return packed.double()
    assert contract.check_packing_invariance(fn, seqs, n_packings=4, pad_to=64).passed
    pads = torch.cat([p for p in seen if p is not None])
    assert pads.numel() == 4 * 50 and int(pads.min()) >= 3 and int(pads.max()) < 1000
    assert len(set(pads.tolist())) > 10
