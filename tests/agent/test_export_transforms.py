"""Known transformations keep the contract (interpreter); export writes a module with
provenance that the backend registry picks up for its arch only (fingerprint included)."""
import importlib.util

import pytest
import torch

from areal_tik.agent.evaluator import Evaluator
from areal_tik.agent.kinds import regions
from areal_tik.agent.export import ExportRefused, export_best
from areal_tik.agent.proposers.transforms import TRANSFORMS, apply_transform
from areal_tik.agent.records import Contract, KernelVersion, Measurement, Run, Workload, content_hash
from areal_tik.agent.roots import load_root
from areal_tik.agent.store import Store
from areal_tik.agent.tasks import get_task

KIND, ROOT, META = load_root("linear")


def test_transforms_pass_every_check(tmp_path):
    task = get_task("linear")
    wls = [dict(w, id=i + 1) for i, w in enumerate(task.workloads("tiny"))]
    src = ROOT
    ev = Evaluator(str(tmp_path), timeout_s=300)
    try:
        names = [n for n, (region, _) in TRANSFORMS.items() if region in regions(ROOT)]  # the linear root's
        assert names == ["grouped-order", "unmasked-k-loop", "persistent"]
        for name in names:               # cumulative: each on top of the previous ones
            src = apply_transform(src, name)
            meta = {"buckets": [dict(META["buckets"][0], GROUP_M=2, PROGS_PER_SM=1, BLOCK_M=16, BLOCK_N=16)]}
            res = ev.evaluate({"op": "linear", "contract": task.contract_spec("tiny"), "workloads": wls,
                               "timer": "none", "candidate": {"kind": KIND, "source": src, "meta": meta,
                                                              "key": content_hash(KIND, "linear", src, meta)}})
            assert res["passed"], (name, [c for c in res["checks"] if not c["passed"]][:2])
    finally:
        ev.close()


def _gpu_run(tmp_path, timer="gpu"):
    s = Store(str(tmp_path / "ir.sqlite"))
    run = s.add_run(Run(name="g", op="linear", kind=KIND, timer=timer, env={"gpu": {"arch": "sm_90"}}))
    s.freeze_contract(Contract(run_id=run.id, op="linear", spec={"rtol": 1e-2}))
    w = s.add_workload(Workload(run_id=run.id, name="w", shape={"M": 5, "N": 48, "K": 64}))
    v = s.add_version(KernelVersion(run_id=run.id, op="linear", kind=KIND, source=ROOT, meta=META, status="verified"))
    s.add_measurement(Measurement(run_id=run.id, version_id=v.id, workload_id=w.id, session="s", latency_us=2.0,
                                  simulated=(timer != "gpu")))
    s.update_run(run.id, root_version=v.id, best_version=v.id)
    return s


def test_export_module_provenance_and_registry_hook(tmp_path, export_registration):
    s = _gpu_run(tmp_path)
    out = tmp_path / "exported"
    r = export_best(s, "g", out_dir=str(out))
    assert r["py"].endswith("linear_sm90.py")
    spec = importlib.util.spec_from_file_location("tik_exp_test", r["py"])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.PROVENANCE["version_hash"] == r["hash"] and mod.ARCH == "sm_90"
    assert mod.PROVENANCE["lineage"][0]["hash"] == r["hash"] and mod.EXPORT_META == META
    x = torch.randn(2, 3, 64).bfloat16()
    w = (torch.randn(48, 64) / 8).bfloat16()
    y = mod.OPS["linear"]["triton"](x, w)
    assert y.shape == (2, 3, 48)
    ref = (x.double() @ w.double().T)
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-2

    # registry: picked up on an sm90 GPU only, and the exported file joins the fingerprinted sources
    export_registration(out, "linear", "triton", r["hash"])


def test_export_refuses_simulated(tmp_path):
    s = _gpu_run(tmp_path, timer="simulated")
    with pytest.raises(ExportRefused):
        export_best(s, "g", out_dir=str(tmp_path / "x"))


def _absolute_paths(obj, found=None):
    """Every string in obj (nested dicts / lists) that is an absolute path (no whitespace: C source and
    descriptions are not paths)."""
    import re
    found = [] if found is None else found
    if isinstance(obj, dict):
        for v in obj.values():
            _absolute_paths(v, found)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _absolute_paths(v, found)
    elif isinstance(obj, str) and re.fullmatch(r"(/|[A-Za-z]:[\\/])\S+", obj):
        found.append(obj)
    return found


def test_export_records_no_absolute_path(tmp_path, monkeypatch):
    """The store path in an export's provenance is relative to the directory holding the package, or the
    file name when the store lies elsewhere; neither the module nor its JSON twin holds an absolute path."""
    import json
    import os

    from areal_tik.agent import export as exp
    s = _gpu_run(tmp_path)  # a store outside the package's directory: its file name only
    r = export_best(s, "g", out_dir=str(tmp_path / "exported"))
    for path in (r["py"], r["json"]):
        assert str(tmp_path) not in open(path).read(), path
    spec = importlib.util.spec_from_file_location("tik_exp_abs_test", r["py"])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.PROVENANCE["db"] == "ir.sqlite" and not _absolute_paths(mod.PROVENANCE)
    assert not _absolute_paths(json.load(open(r["json"])))
    # a store below the package's directory: the path relative to it
    monkeypatch.setattr(exp, "_PACKAGE_ROOT", str(tmp_path))
    assert exp.portable_path(str(tmp_path / "bench" / "results" / "x" / "agent.sqlite")) == "bench/results/x/agent.sqlite"
    assert exp.portable_path(os.path.join(os.path.dirname(str(tmp_path)), "other.sqlite")) == "other.sqlite"


def test_committed_exports_record_no_absolute_path():
    """Every export shipped in the package (module and JSON twin) is free of machine paths."""
    import glob
    import json
    import os

    from areal_tik.agent.export import EXPORT_DIR
    for js in sorted(glob.glob(os.path.join(EXPORT_DIR, "*.json"))):
        assert not _absolute_paths(json.load(open(js))), js
    for py in sorted(glob.glob(os.path.join(EXPORT_DIR, "*.py"))):
        if os.path.basename(py) == "__init__.py":
            continue
        spec = importlib.util.spec_from_file_location("tik_exp_committed_" + os.path.basename(py)[:-3], py)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        assert not _absolute_paths(getattr(mod, "PROVENANCE", {})), py
