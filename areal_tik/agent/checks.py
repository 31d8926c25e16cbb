"""The contract checks of one candidate, run in the evaluator's worker process with the checkers
of :mod:`areal_tik.verify.contract`, and :func:`first_failure`, the check that names a rejection.

Checks, per shape (the workloads' shapes, then the contract's probe shapes not in the
workload set), in the order used to name a failure:

``load``  the source imports and defines the entry point;
``runs``  it runs on every workload shape;
``outputs_written``  every output element is written (output poisoned with a NaN pattern);
``inputs_unchanged``  inputs keep their bits (fresh inputs, never seen by the kernel);
``accuracy``  relative error against the float64 reference <= rtol;
``shape_generality``  the same at probe shapes the workloads do not name (a kernel that
    hard-codes a shape fails here);
``fresh_inputs``  accuracy on a second, freshly drawn input set of the same shape (a
    kernel returning a cached result fails here);
``determinism``  two runs on the same inputs give the same bits;
``row_subset_invariance``  rows computed alone (1 row, a random subset, the first half)
    equal the same rows of the full batch, bit for bit;
``batch_extension_invariance``  the batch extended to 2M+3 rows gives the same bits on the
    first M rows (crosses the kernel's M buckets).
"""
from __future__ import annotations

import json
import random
import traceback

__all__ = ["CHECK_ORDER", "first_failure", "run_checks"]

CHECK_ORDER = ["process", "load", "runs", "outputs_written", "inputs_unchanged", "accuracy", "shape_generality",
               "fresh_inputs", "determinism", "row_subset_invariance", "batch_extension_invariance"]


def first_failure(checks: list[dict]) -> dict | None:
    """The failing check that names the rejection (earliest in CHECK_ORDER)."""
    bad = [c for c in checks if not c["passed"]]
    if not bad:
        return None
    rank = {n: i for i, n in enumerate(CHECK_ORDER)}
    return min(bad, key=lambda c: rank.get(c["check"], len(rank)))


def _check_shape(task, kern, meta, shape: dict, role: str, rtol: float, seed: int, device: str, add) -> None:
    """Run every check for one shape; ``add(check, passed, detail)`` records each."""
    # lazy: keeps torch out of this module's import
    from areal_tik.verify import contract as C
    import torch

    label = json.dumps(shape, sort_keys=True)
    acc_name = "accuracy" if role == "workload" else "shape_generality"

    def run(inputs, out=None):
        out = task.alloc_out(inputs) if out is None else out
        return task.call(kern, inputs, out, meta)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    try:
        inp1 = task.make_inputs(shape, seed, device)
        ref1 = task.reference({k: (v.clone() if v is not None else None) for k, v in inp1.items()})
        out1 = task.alloc_out(inp1)
        rep = C.check_outputs_written(lambda o: (run(inp1, o), sync()), out1)
        add("outputs_written", rep.passed, rep.to_dict(), label)
        inp_fresh = task.make_inputs(shape, seed + 7, device)
        rep = C.check_inputs_unchanged(lambda *t: (run(inp_fresh), sync()), *task.tensors(inp_fresh))
        add("inputs_unchanged", rep.passed, rep.to_dict(), label)
        rep = C.check_accuracy(out1, ref1, rtol, name=acc_name)
        add(acc_name, rep.passed, rep.to_dict(), label)
        # Drawn per audit from the OS, never from the frozen contract seed, so no candidate
        # can have seen (or precomputed answers for) these inputs; the seed is recorded.
        fresh_seed = random.SystemRandom().randrange(2**31)
        inp2 = task.make_inputs(shape, fresh_seed, device)
        ref2 = task.reference({k: (v.clone() if v is not None else None) for k, v in inp2.items()})
        out2 = run(inp2)
        sync()
        rep = C.check_accuracy(out2, ref2, rtol, name="fresh_inputs")
        add("fresh_inputs", rep.passed, {**rep.to_dict(), "seed": fresh_seed}, label)
        out1b = run(inp1)
        sync()
        rep = C.compare_bits(out1, out1b, name="determinism")
        add("determinism", rep.passed, rep.to_dict(), label)
        # batch axis: subsets and an extension of the rows
        xb = task.batch_tensor(inp1)
        m = task.batch_size(inp1)
        g = torch.Generator().manual_seed(seed + 3)
        subsets = [[0], [m - 1]]
        if m > 2:
            subsets.append(sorted(torch.randperm(m, generator=g)[: max(2, min(m - 1, 7))].tolist()))
            subsets.append(list(range(max(1, m // 2))))
        rep = C.check_row_subset_invariance(lambda xs: run(task.with_rows(inp1, xs)), xb, subsets,
                                            name="row_subset_invariance")
        add("row_subset_invariance", rep.passed, rep.to_dict(), label)
        extra = task.make_inputs({**shape, "M": m + 3}, seed + 5, device)["x"]  # -> 2M+3 rows
        x_ext = torch.cat([xb, extra], 0).contiguous()
        out_ext = run(task.with_rows(inp1, x_ext))
        sync()
        rep = C.compare_bits(out_ext[:m], out1, name="batch_extension_invariance")
        add("batch_extension_invariance", rep.passed, rep.to_dict() | {"extended_to": int(x_ext.shape[0])}, label)
    except Exception as e:  # a kernel that raises fails the check it was in
        name = "runs" if role == "workload" else "shape_generality"
        add(name, False, {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}, label)
        if device == "cuda" and "CUDA" in str(e):
            raise SystemExit(f"CUDA error, worker exits: {e}")


def run_checks(task, kern, meta: dict, contract_spec: dict, workloads: list[dict], device: str) -> list[dict]:
    checks: list[dict] = []

    def add(name, passed, detail, shape=""):
        checks.append({"check": name, "passed": bool(passed), "shape": shape, "detail": detail})

    shapes, seen = [], set()
    for wl in workloads:
        key = json.dumps(wl["shape"], sort_keys=True)
        if key not in seen:
            seen.add(key)
            shapes.append((wl["shape"], "workload"))
    for p in contract_spec.get("probe_shapes", []):
        key = json.dumps(p, sort_keys=True)
        if key not in seen:
            seen.add(key)
            shapes.append((p, "probe"))
    base_seed = int(contract_spec.get("seed", 0))
    for i, (shape, role) in enumerate(shapes):
        _check_shape(task, kern, meta, shape, role, float(contract_spec["rtol"]), base_seed + 101 * i, device, add)
    runs_ok = all(c["passed"] for c in checks if c["check"] == "runs")
    add("runs", runs_ok, {"shapes": len(shapes)})
    return checks
