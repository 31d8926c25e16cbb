"""The agent with a csrc kernel as its root: rms_norm starts from csrc/tik_elementwise.cu.

CPU: the root is the csrc file as it stands; the offline proposer moves its build-time knob; the root and
every proposal compile for sm_90a and sm_80 (nvcc -c; skipped without nvcc); the rms_norm task's checks pass
an honest CPU stand-in and catch a batch-dependent or a lazy one; loading a cuda_inline kernel without CUDA
says why. GPU (`-m gpu`): a short agent loop on the real csrc root, whose output bits equal the cuda
backend's rms_norm (the same kernel).
"""
import math
import os
import re
import shutil
import types

import pytest
import torch

from areal_tik.agent.checks import run_checks
from areal_tik.agent.kinds import BINDINGS, get_kind
from areal_tik.agent.proposers import OfflineProposer
from areal_tik.agent.roots import load_root, root_path
from areal_tik.agent.tasks import get_task
from areal_tik.kernels.cuda.loader import CSRC_DIR

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compile check)")


def test_rms_root_is_the_csrc_kernel():
    kind, src, meta = load_root("rms_norm")
    assert kind == "cuda_inline" and root_path("rms_norm") == os.path.join(CSRC_DIR, "tik_elementwise.cu")
    assert src == open(os.path.join(CSRC_DIR, "tik_elementwise.cu")).read()
    assert meta == {"entry": "tik_agent_rms_norm", "binding": "rms_norm", "defines": {"TIK_RMS_WARPS": 4}}
    assert "#ifndef TIK_RMS_WARPS" in src  # the knob the meta sets
    # the binding calls csrc's extern "C" entry with the parameter list tik_api.h declares
    api = " ".join(open(os.path.join(CSRC_DIR, "tik_api.h")).read().split())
    decl = " ".join(BINDINGS["rms_norm"].split("extern \"C\" ", 1)[1].split(";", 1)[0].split())
    assert decl.replace("int tik_rms_norm(", "").replace(" ", "") in api.replace(" ", "")


def _proposals():
    """The offline proposer's candidates from the csrc root: {opportunity key: (source, meta)}."""
    task = get_task("rms_norm")
    kind, src, meta = load_root("rms_norm")
    prop = OfflineProposer()
    opps = prop.opportunities(task, types.SimpleNamespace(meta=meta, source=src), {})
    out = {}
    for o in opps:
        p = prop.propose(task, types.SimpleNamespace(meta=meta, source=src), types.SimpleNamespace(**o), {})
        assert p.ok
        out[o["key"]] = (p.source, p.meta)
    return src, meta, out


def test_offline_proposer_moves_the_csrc_knob_and_transforms_its_regions():
    src, meta, props = _proposals()
    assert sorted(props) == ["define:TIK_RMS_WARPS=2", "define:TIK_RMS_WARPS=8", "transform:row-registers",
                             "transform:vector-loads"]
    for w in (2, 8):
        s2, m2 = props[f"define:TIK_RMS_WARPS={w}"]
        assert s2 == src and m2["defines"]["TIK_RMS_WARPS"] == w
    assert meta["defines"]["TIK_RMS_WARPS"] == 4  # the parent's meta is not mutated
    vs, vm = props["transform:vector-loads"]
    assert vm == meta and vs != src
    # only the two marked regions changed; the rest of the csrc file is intact
    from areal_tik.agent.kinds import regions
    strip = lambda t: re.sub(r"// <tik:(rms-sumsq|rms-scale)>.*?// </tik:\1>", "", t, flags=re.S)  # noqa: E731
    assert strip(vs) == strip(src) and set(regions(vs)) == set(regions(src)) == {"rms-sumsq", "rms-scale"}
    assert "uint4" in regions(vs)["rms-sumsq"] and "uint4" in regions(vs)["rms-scale"]
    rs, rm = props["transform:row-registers"]
    assert rm == meta and strip(rs) == strip(src) and rs != vs
    assert "xg[k] = __ldg" in regions(rs)["rms-sumsq"] and "xg[k]" in regions(rs)["rms-scale"]
    # applied once: not offered again (the other transformation of the same regions still is: an alternative)
    again = OfflineProposer().opportunities(get_task("rms_norm"), types.SimpleNamespace(meta=vm, source=vs), {})
    assert "transform:vector-loads" not in [o["key"] for o in again]
    assert "transform:row-registers" in [o["key"] for o in again]
    again = OfflineProposer().opportunities(get_task("rms_norm"), types.SimpleNamespace(meta=rm, source=rs), {})
    assert "transform:row-registers" not in [o["key"] for o in again]
    edge = OfflineProposer().opportunities(get_task("rms_norm"), types.SimpleNamespace(
        meta={**meta, "defines": {"TIK_RMS_WARPS": 16}}, source=""), {})
    assert [o["key"] for o in edge] == ["define:TIK_RMS_WARPS=8"]


@needs_nvcc
@pytest.mark.parametrize("arch", ["90a", "80"])
def test_root_and_proposals_compile(arch, tmp_path):
    from concurrent.futures import ThreadPoolExecutor
    kind = get_kind("cuda_inline")
    src, meta, props = _proposals()
    jobs = [(src, meta), *props.values(), (src, {**meta, "defines": {"TIK_RMS_WARPS": 64}})]
    with ThreadPoolExecutor(2) as pool:  # each compile is an nvcc subprocess in its own directory: two at a time
        *good, bad = pool.map(lambda job: kind.compile_check(*job, arch=arch, workdir=str(tmp_path)), jobs)
    assert len(good) == 1 + len(props)
    for r in good:
        assert r["ok"], r.get("error")
        rms = [k for k in r["ptxas"] if "rms_norm_kernel" in k]
        assert len(rms) == 3 and all(r["ptxas"][k]["spill_stores"] == 0 for k in rms)
    assert not bad["ok"] and "TIK_RMS_WARPS" in bad["error"]  # the static_assert, not a silent build


def _bf16(t):
    return t.to(torch.bfloat16)


class _Honest:
    """The task's maths on the CPU with the kernel's rounding points (one fp32 row at a time)."""

    def forward(self, x, w, out, eps, meta):
        xf = x.float()
        r = 1.0 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out.copy_(_bf16(w.float() * _bf16(xf * r).float()))


class _BatchMean(_Honest):
    """A cheat: normalises by a statistic over the whole batch (rows change with their neighbours)."""

    def forward(self, x, w, out, eps, meta):
        xf = x.float()
        r = 1.0 / torch.sqrt(xf.pow(2).mean() + eps)
        out.copy_(_bf16(w.float() * _bf16(xf * r).float()))


class _Lazy(_Honest):
    def forward(self, x, w, out, eps, meta):
        if x.shape[0] > 4:
            return  # leaves big batches unwritten
        super().forward(x, w, out, eps, meta)


@pytest.mark.parametrize("kernel,failing", [(_Honest(), set()),
                                            (_BatchMean(), {"row_subset_invariance", "batch_extension_invariance"}),
                                            (_Lazy(), {"outputs_written", "accuracy", "fresh_inputs"})])
def test_rms_task_checks(kernel, failing):
    task = get_task("rms_norm")
    checks = run_checks(task, kernel, {}, task.contract_spec("tiny"), task.workloads("tiny"), "cpu")
    bad = {c["check"] for c in checks if not c["passed"]}
    assert failing <= bad if failing else not bad, bad
    if not failing:
        assert {c["check"] for c in checks} >= {"accuracy", "row_subset_invariance", "batch_extension_invariance",
                                                 "fresh_inputs", "determinism", "shape_generality"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
def test_cuda_inline_needs_cuda_and_says_so(tmp_path):
    kind, src, meta = load_root("rms_norm")
    with pytest.raises(RuntimeError, match="CUDA"):
        get_kind(kind).load(src, meta, "k", str(tmp_path))


def test_rms_task_reference_and_model():
    task = get_task("rms_norm")
    inp = task.make_inputs({"M": 4, "N": 64}, 3, "cpu")
    ref = task.reference(inp)
    x = inp["x"].double()
    assert torch.allclose(ref[1], inp["w"].double() * x[1] / torch.sqrt((x[1] ** 2).mean() + task.eps))
    lat = task.simulated_latency_us({"M": 4096, "N": 1536}, {"defines": {"TIK_RMS_WARPS": 4}}, "src")
    assert math.isfinite(lat) and lat > 0


@pytest.mark.gpu
@pytest.mark.timeout(900)  # three load_inline builds (root and two transformations) of ~30-60 s each
def test_agent_loop_on_the_csrc_root_gpu(tmp_path):
    """Init + 2 candidates on the GPU timer; the root's bits are the cuda backend's rms_norm bits, and both
    transformations' (vector-loads, row-registers) bits are the root's. The direct loads below use the evaluator's work
    directory and the versions' content hashes as keys, so its worker finds those builds done."""
    from areal_tik.dispatch import ops
    from areal_tik.agent import roles
    from areal_tik.agent.evaluator import Evaluator
    from areal_tik.agent.loop import Budget, run_loop
    from areal_tik.agent.proposers.transforms import apply_transform
    from areal_tik.agent.records import content_hash
    from areal_tik.agent.store import Store
    from areal_tik.dispatch.fingerprint import environment

    kind, src, meta = load_root("rms_norm")
    work = str(tmp_path / "work")
    root = get_kind(kind).load(src, meta, content_hash(kind, "rms_norm", src, meta), work)
    g = torch.Generator(device="cpu").manual_seed(11)
    for m, n in [(1, 1536), (37, 1536), (300, 8960), (5, 200)]:
        x = torch.randn(m, n, generator=g).bfloat16().cuda()
        w = (1 + 0.1 * torch.randn(n, generator=g)).bfloat16().cuda()
        out = torch.full_like(x, float("nan"))
        root.forward(x, w, out, 1e-6, meta)
        assert torch.equal(out, ops.rms_norm(x, w, 1e-6, backend="cuda")), (m, n)
    # the vector-loads transformation: the root's bits, on aligned rows, rows at an odd stride (scalar path)
    # and widths that are not a multiple of 8 (the tail group)
    # (row-registers: also the longest register-held row, 4096, and one past it, 4104, on the element loops)
    vsrc = apply_transform(src, "vector-loads")
    rsrc = apply_transform(src, "row-registers")
    for tsrc in (vsrc, rsrc):
        vec = get_kind(kind).load(tsrc, meta, content_hash(kind, "rms_norm", tsrc, meta), work)
        for m, n, stride in [(64, 1536, 1536), (7, 1536, 1537), (9, 1000, 1000), (3, 8960, 8960), (2, 13, 13),
                             (5, 4096, 4096), (4, 4104, 4104), (6, 1536, 1544)]:
            base = torch.randn(m, stride, generator=g).bfloat16().cuda()
            x = base[:, :n]
            w = (1 + 0.1 * torch.randn(n, generator=g)).bfloat16().cuda()
            a = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            b = torch.full_like(a, float("nan"))
            root.forward(x, w, a, 1e-6, meta)
            vec.forward(x, w, b, 1e-6, meta)
            assert torch.equal(a, b), (tsrc is rsrc, m, n, stride)

    store = Store(str(tmp_path / "ir.sqlite"))
    ev = Evaluator(work, timeout_s=600)
    env = environment()
    try:
        run = roles.initialize(store, ev, OfflineProposer(), "rms", "rms_norm", "qwen2.5-1.5b", "gpu",
                               device=(env.get("gpu") or {}).get("name", "cuda"), env=env)
        assert run.status == "initialized", roles.summarize(store, run.id)
        summ = run_loop(store, "rms", OfflineProposer(), ev, Budget(max_candidates=2))
    finally:
        ev.close()
    run = store.run("rms")
    vs = store.versions(run.id)
    assert vs[0].origin == "root" and vs[0].status == "verified" and vs[0].source == src
    assert len(vs) == 3 and not store.versions(run.id, "pending")
    for v in vs:
        assert store.checks(v.id), f"version {v.id} has no recorded checks"
        # a knob move keeps the csrc text; the transformations the proposer knows for it rewrite the regions
        assert v.kind == "cuda_inline" and v.source in (src, vsrc, rsrc), v.origin
    # the two transformations outrank the knob moves
    assert {v.source for v in vs[1:]} == {vsrc, rsrc}, "the proposer did not try both transformations first"
    assert not summ["SIMULATED"] and summ["status"] == "stopped"
    final = next(d for d in reversed(store.decisions(run.id)) if d.action == "stop")
    assert final.data.get("speedup", 0) > 0


def _rms_gpu_store(tmp_path, source=None, defines=None, kind=None):
    """A store holding one verified, GPU-timed rms_norm version (the csrc root, or `source` / `defines` / `kind`)."""
    from areal_tik.agent.records import Contract, KernelVersion, Measurement, Run, Workload
    from areal_tik.agent.store import Store
    root_kind, src, meta = load_root("rms_norm")
    kind = kind or root_kind
    if defines:
        meta["defines"].update(defines)
    s = Store(str(tmp_path / "ir.sqlite"))
    run = s.add_run(Run(name="r", op="rms_norm", kind=kind, timer="gpu", env={"gpu": {"arch": "sm_90"}}))
    s.freeze_contract(Contract(run_id=run.id, op="rms_norm", spec={"rtol": 1e-2}))
    w = s.add_workload(Workload(run_id=run.id, name="w", shape={"M": 4, "N": 1536}))
    v = s.add_version(KernelVersion(run_id=run.id, op="rms_norm", kind=kind, source=source or src, meta=meta,
                                    status="verified"))
    s.add_measurement(Measurement(run_id=run.id, version_id=v.id, workload_id=w.id, session="s", latency_us=3.0,
                                  simulated=False))
    s.update_run(run.id, root_version=v.id, best_version=v.id)
    return s, (source or src), meta


def _import(path, name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rms_export_module_and_registry_hook(tmp_path, export_registration):
    """Export of a csrc-rooted version: the module embeds the CUDA source and its binding verbatim, imports on a
    CPU (the build is lazy), says why it cannot run without CUDA, and registers as rms_norm's cuda implementation
    on its arch only, its file first among the fingerprinted sources."""
    from areal_tik.agent.export import export_best
    from areal_tik.agent.proposers.transforms import apply_transform
    src = apply_transform(load_root("rms_norm")[1], "vector-loads")
    s, src, meta = _rms_gpu_store(tmp_path, source=src, defines={"TIK_RMS_WARPS": 8})
    out = tmp_path / "exported"
    r = export_best(s, "r", out_dir=str(out))
    assert r["py"].endswith("rms_norm_sm90.py")
    mod = _import(r["py"], "tik_exp_rms_test")
    assert mod.SOURCE == src and mod.BINDING == BINDINGS["rms_norm"] and mod.EXPORT_META == meta
    assert mod.EXPORT_META["defines"]["TIK_RMS_WARPS"] == 8 and mod.PROVENANCE["version_hash"] == r["hash"]
    fn = mod.OPS["rms_norm"]["cuda"]
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            fn(torch.randn(3, 16).bfloat16(), torch.ones(16).bfloat16(), 1e-6)
    export_registration(out, "rms_norm", "cuda", r["hash"])


def test_export_refuses_an_op_kind_without_adapter(tmp_path):
    from areal_tik.agent.export import ExportRefused, export_best
    s, _, _ = _rms_gpu_store(tmp_path, kind="triton")   # rms_norm has no Triton-kind adapter
    with pytest.raises(ExportRefused, match="no export adapter for op 'rms_norm' with kind 'triton'"):
        export_best(s, "r", out_dir=str(tmp_path / "x"))


@pytest.mark.gpu
@pytest.mark.timeout(600)  # one load_inline build
def test_rms_export_runs_the_version_gpu(tmp_path):
    """The exported module's bf16 forward is the exported version's kernel: the csrc root's bits are the cuda
    backend's rms_norm bits (same kernel, same knob), on NaN-poisoned outputs; its backward matches float64; other
    dtypes take the csrc rms_norm."""
    from areal_tik.dispatch import ops
    from areal_tik.agent.export import export_best
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    s, _, _ = _rms_gpu_store(tmp_path)
    mod = _import(export_best(s, "r", out_dir=str(tmp_path / "exported"))["py"], "tik_exp_rms_gpu")
    fn = mod.OPS["rms_norm"]["cuda"]
    g = torch.Generator(device="cpu").manual_seed(5)
    for shape in [(1, 1536), (3, 37, 1536), (300, 8960), (5, 200)]:
        x = torch.randn(*shape, generator=g).bfloat16().cuda()
        w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).bfloat16().cuda()
        assert torch.equal(fn(x, w, 1e-6), ops.rms_norm(x, w, 1e-6, backend="cuda")), shape
    x = torch.randn(7, 64, generator=g).bfloat16().cuda().requires_grad_(True)
    w = torch.ones(64).bfloat16().cuda().requires_grad_(True)
    fn(x, w, 1e-6).float().sum().backward()
    xd = x.detach().double().requires_grad_(True)
    (w.detach().double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)).sum().backward()
    assert torch.allclose(x.grad.double(), xd.grad, rtol=2e-2, atol=2e-2)
    xf = torch.randn(4, 64, generator=g).cuda()
    assert torch.equal(fn(xf, torch.ones(64).cuda(), 1e-6), ops.rms_norm(xf, torch.ones(64).cuda(), 1e-6, backend="cuda"))
