"""Checkers for the numerical contract (docs/design.md section 2).

Everyone who must judge a kernel uses these: the tests, the trainer's audit and the
agent's evaluator. Each checker returns a :class:`Report` (counts, max |diff|, first
mismatching index), never a bare bool, so a failure says *where* and *how much*.

Bitwise comparisons look at raw bit patterns (so ``-0.0 != +0.0`` and two NaNs with the
same payload are equal); that is stricter than ``torch.equal`` and agrees with it on
every finite, non-zero value.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Mapping, Sequence

import torch

__all__ = [
    "Report",
    "ContractViolation",
    "compare_bits",
    "check_row_subset_invariance",
    "check_packing_invariance",
    "check_regime_equality",
    "check_accuracy",
    "check_outputs_written",
    "check_inputs_unchanged",
    "poison_",
    "POISON_BITS",
]


class ContractViolation(AssertionError):
    """Raised by :meth:`Report.raise_if_failed`; carries the report."""

    def __init__(self, report: "Report"):
        super().__init__(report.summary())
        self.report = report


@dataclasses.dataclass
class Report:
    """Outcome of one contract check.

    ``n_compared`` elements were compared, ``n_mismatch`` differed; ``max_abs_diff`` is
    over the finite differing pairs (``inf`` when a NaN/inf pattern differs);
    ``first_mismatch`` is the multi-index of the first differing element in the
    compared tensor (or a string naming the case for composite checks).
    """

    check: str
    passed: bool
    n_compared: int = 0
    n_mismatch: int = 0
    max_abs_diff: float = 0.0
    first_mismatch: object = None
    detail: str = ""
    rel_error: float | None = None
    cases: list = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:  # lets `assert report` read naturally
        return self.passed

    def summary(self) -> str:
        s = (f"[{'PASS' if self.passed else 'FAIL'}] {self.check}: "
             f"{self.n_mismatch}/{self.n_compared} mismatching, max|diff|={self.max_abs_diff:.6g}")
        if self.rel_error is not None:
            s += f", rel_err={self.rel_error:.3g}"
        if self.first_mismatch is not None:
            s += f", first at {self.first_mismatch}"
        if self.detail:
            s += f" ({self.detail})"
        return s

    __str__ = summary

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["first_mismatch"] = None if self.first_mismatch is None else str(self.first_mismatch)
        d["cases"] = [c.to_dict() if isinstance(c, Report) else c for c in self.cases]
        return d

    def raise_if_failed(self) -> "Report":
        if not self.passed:
            raise ContractViolation(self)
        return self


def _merge(check: str, parts: Sequence[Report], detail: str = "") -> Report:
    """Combine sub-checks. Nothing compared is a failure, never a vacuous pass."""
    if not parts:
        detail = (detail + "; " if detail else "") + "nothing compared"
    rep = Report(check=check, passed=bool(parts) and all(p.passed for p in parts), detail=detail, cases=list(parts))
    for p in parts:
        rep.n_compared += p.n_compared
        rep.n_mismatch += p.n_mismatch
        rep.max_abs_diff = max(rep.max_abs_diff, p.max_abs_diff)
        if rep.first_mismatch is None and not p.passed:
            rep.first_mismatch = f"{p.check}@{p.first_mismatch}"
    return rep


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype == torch.bool or not (t.is_floating_point() or t.is_complex()):
        return t
    return t.view(_INT_VIEW[t.element_size()])


def compare_bits(a: torch.Tensor, b: torch.Tensor, name: str = "bits") -> Report:
    """Bitwise equality of two tensors of one shape and dtype, with mismatch statistics."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return Report(name, False, detail=f"shape/dtype differ: {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}")
    a_, b_ = a.detach().cpu(), b.detach().cpu()
    diff_mask = _bits(a_) != _bits(b_)
    n_mis = int(diff_mask.sum())
    rep = Report(name, n_mis == 0, n_compared=a_.numel(), n_mismatch=n_mis)
    if n_mis:
        idx = torch.nonzero(diff_mask.reshape(a_.shape) if a_.dim() else diff_mask.reshape(1))[0]
        rep.first_mismatch = tuple(int(i) for i in idx)
        if a_.is_floating_point():
            da, db = a_.double()[diff_mask], b_.double()[diff_mask]
            d = (da - db).abs()
            rep.max_abs_diff = float(d.max()) if torch.isfinite(d).all() else math.inf
    return rep


def check_row_subset_invariance(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    subsets: Iterable[Sequence[int] | torch.Tensor],
    name: str = "row-subset invariance",
) -> Report:
    """Rows S computed alone must equal rows S of the full batch, bit for bit.

    ``fn`` maps a ``[M, ...]`` batch to a ``[M, ...]`` result row by row.
    """
    full = fn(x)
    parts = []
    for s in subsets:
        idx = torch.as_tensor(s, dtype=torch.long, device=x.device)
        alone = fn(x.index_select(0, idx).contiguous())
        parts.append(compare_bits(alone, full.index_select(0, idx), name=f"rows[{len(idx)}]"))
    return _merge(name, parts, detail=f"M={x.shape[0]}")


def check_packing_invariance(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    seqs: Sequence[torch.Tensor],
    n_packings: int = 3,
    pad_to: int = 1,
    generator: torch.Generator | None = None,
    name: str = "packing invariance",
) -> Report:
    """Each sequence's rows must be the same alone and packed with any neighbours.

    ``fn(packed, cu_seqlens)`` takes the sequences concatenated along dim 0 (``cu_seqlens``
    int32 prefix sums, a trailing padding segment allowed) and returns one row per token.
    Each packing uses a random order of the sequences and pads the total to a multiple of
    ``pad_to`` with random tokens that form their own segment (floats: normal draws;
    integer token ids: uniform over the range the sequences use). Without ``generator``
    the packings are drawn from the global torch RNG (fresh per test under ``seed_rng``).
    """
    g = generator or torch.Generator().manual_seed(int(torch.randint(2**62, ())))
    dev = seqs[0].device
    solo = []
    for s in seqs:
        cu = torch.tensor([0, s.shape[0]], dtype=torch.int32, device=dev)
        solo.append(fn(s, cu))
    parts = []
    for p in range(n_packings):
        order = torch.randperm(len(seqs), generator=g).tolist()
        chunks = [seqs[i] for i in order]
        total = sum(c.shape[0] for c in chunks)
        pad = (-total) % pad_to
        if pad:
            filler = seqs[0][:1].expand(pad, *seqs[0].shape[1:]).clone()
            if filler.is_floating_point():
                filler = torch.randn(filler.shape, generator=g).to(filler)
            elif filler.dtype != torch.bool:
                lo = min(int(s.min()) for s in seqs if s.numel())
                hi = max(int(s.max()) for s in seqs if s.numel())
                filler = torch.randint(lo, hi + 1, filler.shape, generator=g).to(filler)
            chunks = chunks + [filler]
        lens = [c.shape[0] for c in chunks]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=dev)
        out = fn(torch.cat(chunks, 0), cu)
        for j, i in enumerate(order):
            seg = out[int(cu[j]):int(cu[j + 1])]
            parts.append(compare_bits(solo[i], seg, name=f"packing{p}/seq{i}@{int(cu[j])}"))
    return _merge(name, parts, detail=f"{len(seqs)} sequences, {n_packings} packings, pad_to={pad_to}")


def check_regime_equality(outputs: Mapping[str, torch.Tensor], name: str = "regime equality") -> Report:
    """Every regime's output equals the first one's, bit for bit."""
    items = list(outputs.items())
    if len(items) < 2:
        return Report(name, False, detail="need at least two regimes")
    base_name, base = items[0]
    parts = [compare_bits(base, t, name=f"{base_name}=={k}") for k, t in items[1:]]
    return _merge(name, parts, detail=", ".join(outputs))


def check_accuracy(
    out: torch.Tensor,
    ref: torch.Tensor,
    rtol: float,
    name: str = "float64 accuracy",
) -> Report:
    """Relative Frobenius error ``||out-ref|| / ||ref||`` against a float64 reference.

    NaN or inf in ``out`` where ``ref`` is finite always fails.
    """
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if o.shape != r.shape:
        return Report(name, False, detail=f"shape {tuple(o.shape)} vs reference {tuple(r.shape)}")
    bad = ~torch.isfinite(o) & torch.isfinite(r)
    diff = (o - r).abs()
    diff = torch.where(bad, torch.full_like(diff, math.inf), diff)
    denom = float(r.norm())
    finite = diff[torch.isfinite(diff)]
    rel = float(finite.norm()) / denom if denom > 0 else float(finite.norm())
    n_bad = int(bad.sum())
    passed = n_bad == 0 and rel <= rtol
    rep = Report(name, passed, n_compared=o.numel(), n_mismatch=n_bad, rel_error=rel,
                 max_abs_diff=float(diff.max()) if diff.numel() else 0.0, detail=f"rtol={rtol:g}")
    if n_bad:
        rep.first_mismatch = tuple(int(i) for i in torch.nonzero(bad)[0])
    return rep


# A quiet-NaN payload no arithmetic produces, per element size.
POISON_BITS = {2: 0x7FA5, 4: 0x7FC0A5A5, 8: 0x7FF80000A5A5A5A5}


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with a recognisable NaN pattern (floats) or -1 (integers)."""
    if t.is_floating_point():
        bits = POISON_BITS[t.element_size()]
        iv = _INT_VIEW[t.element_size()]
        if t.element_size() == 2 and bits > 0x7FFF:
            bits -= 1 << 16
        t.view(iv).fill_(bits)
    else:
        t.fill_(-1)
    return t


def check_outputs_written(
    run: Callable[[torch.Tensor], object],
    out: torch.Tensor,
    name: str = "every output written",
) -> Report:
    """Poison ``out``, call ``run(out)`` (which must fill it), count elements still poisoned."""
    poison_(out)
    run(out)
    if out.is_floating_point():
        still = _bits(out) == torch.tensor(_bits(poison_(torch.empty(1, dtype=out.dtype, device=out.device)))[0].item(),
                                           device=out.device)
    else:
        still = out == -1
    n = int(still.sum())
    rep = Report(name, n == 0, n_compared=out.numel(), n_mismatch=n)
    if n:
        rep.first_mismatch = tuple(int(i) for i in torch.nonzero(still.reshape(out.shape))[0])
    return rep


def check_inputs_unchanged(
    run: Callable[..., object],
    *inputs: torch.Tensor,
    name: str = "inputs unchanged",
) -> Report:
    """Call ``run(*inputs)`` and check every input tensor kept its bits."""
    before = [t.detach().clone() for t in inputs]
    run(*inputs)
    parts = [compare_bits(b, t, name=f"input{i}") for i, (b, t) in enumerate(zip(before, inputs))]
    return _merge(name, parts)
