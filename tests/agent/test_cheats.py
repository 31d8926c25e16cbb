"""Scripted (replay) proposer feeding known cheats: each must be rejected, in the IR, for
the right reason; an honest candidate passes. Runs on the CPU interpreter."""
import pytest

from areal_tik.agent import roles
from areal_tik.agent.evaluator import Evaluator
from areal_tik.agent.kinds import replace_region
from areal_tik.agent.loop import Budget, run_loop
from areal_tik.agent.proposers import ReplayProposer
from areal_tik.agent.roots import load_root
from areal_tik.agent.store import Store

KIND, ROOT, META = load_root("linear")
LAUNCH = "    cfg = _bucket(meta, m)\n"


def _before_launch(code: str) -> str:
    assert LAUNCH in ROOT
    return ROOT.replace(LAUNCH, LAUNCH + code)


def _after_launch(code: str) -> str:
    assert ROOT.rstrip().endswith("return out")
    return ROOT.rstrip()[: -len("return out")] + code + "    return out\n"


CHEATS = {
    # the last output tile is never launched
    "outputs_written": replace_region(ROOT, "grid", "return (max(1, tiles - 1),)"),
    # uses its input as scratch space after computing
    "inputs_unchanged": _after_launch("x[-1].zero_()\n"),
    # large batches take another path: two separately rounded half-K products
    "row_subset_invariance": _before_launch(
        "    if m > 8:\n"
        "        k2 = k // 2\n"
        "        y = x[:, :k2] @ w[:, :k2].T + x[:, k2:] @ w[:, k2:].T\n"
        "        out.copy_(y + bias if bias is not None else y)\n"
        "        return out\n"),
    # only the benchmarked shapes are computed
    "shape_generality": _before_launch(
        "    if (n, k) not in {(48, 64), (32, 96)}:\n"
        "        out.zero_()\n"
        "        return out\n"),
    # returns the result cached from the first call of a shape
    "fresh_inputs": "_CACHE = {}\n" + _before_launch(
        "    key = (m, n, k, bias is not None)\n"
        "    if key in _CACHE:\n"
        "        out.copy_(_CACHE[key])\n"
        "        return out\n").replace(
        "        num_warps=cfg[\"num_warps\"], num_stages=cfg[\"num_stages\"])\n",
        "        num_warps=cfg[\"num_warps\"], num_stages=cfg[\"num_stages\"])\n    _CACHE[key] = out.clone()\n"),
    # does not even import
    "load": ROOT.replace("def forward(", "def forward(:"),
}


@pytest.fixture(scope="module")
def cheat_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("cheats")
    script = [{"source": src, "meta": META, "description": f"cheat expecting {chk}"} for chk, src in CHEATS.items()]
    honest_meta = {"buckets": [dict(META["buckets"][0], BLOCK_N=16, num_warps=2)]}
    script.append({"source": ROOT, "meta": honest_meta, "description": "honest retune"})
    store = Store(str(d / "ir.sqlite"))
    ev = Evaluator(str(d / "work"), timeout_s=300)
    prop = ReplayProposer(script)
    try:
        roles.initialize(store, ev, prop, "cheats", "linear", "tiny", "simulated")
        summ = run_loop(store, "cheats", prop, ev, Budget(max_candidates=len(script), stagnation=100))
    finally:
        ev.close()
    return store, summ


@pytest.mark.parametrize("expected", list(CHEATS))
def test_cheat_rejected_with_right_reason(cheat_run, expected):
    store, _ = cheat_run
    run = store.run("cheats")
    v = next(v for v in store.versions(run.id) if v.description == f"cheat expecting {expected}")
    assert v.status == "failed"
    (dec,) = [d for d in store.decisions(run.id, v.id) if d.action == "reject"]
    assert dec.data["check"] == expected, dec.reason
    assert dec.reason.startswith(expected)
    failing = {c.check for c in store.checks(v.id) if not c.passed}
    assert expected in failing
    assert store.version(v.id).source == CHEATS[expected]      # kept as evidence


def test_honest_candidate_passes_and_cheats_never_parent(cheat_run):
    store, summ = cheat_run
    run = store.run("cheats")
    honest = next(v for v in store.versions(run.id) if v.description == "honest retune")
    assert honest.status == "verified"
    assert all(c.passed for c in store.checks(honest.id))
    failed = {v.id for v in store.versions(run.id, "failed")}
    assert len(failed) == len(CHEATS)
    assert not failed & {e.parent_id for e in store.edges(run.id)}
    assert not failed & {b.head_version for b in store.branches(run.id)}
    assert summ["rejections_by_check"] == {k: 1 for k in CHEATS}
