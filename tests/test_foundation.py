"""Foundation: interpreter fix, CLI, registry selection and the no-GPU compile checks."""
import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest

from areal_tik.settings import BACKEND_ENV, Settings
import torch

from areal_tik.dispatch import fingerprint, registry
from areal_tik.dispatch.bound import bind

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_interpreter_bf16_dot_and_sum_are_fixed(seed_rng):
    import triton
    import triton.language as tl

    @triton.jit
    def k(a_ptr, b_ptr, c_ptr, s_ptr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
        tl.store(c_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b))
        tl.store(s_ptr + r, tl.sum(a, axis=1))

    a, b = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
    c, s = torch.empty(16, 16), torch.empty(16, dtype=torch.bfloat16)
    k[(1,)](a, b, c, s)
    assert torch.allclose(c, a.float() @ b.float(), atol=1e-4)
    assert torch.allclose(s.float(), a.float().sum(1), atol=0.1, rtol=1e-2)

    # fp32 -> bf16 casts round to nearest even like the GPU (the stock interpreter truncates)
    @triton.jit
    def cast(x_ptr, y_ptr):
        r = tl.arange(0, 1024)
        tl.store(y_ptr + r, tl.load(x_ptr + r).to(tl.bfloat16))

    x = torch.randn(1024) * torch.exp2(torch.randint(-20, 20, (1024,)).float())
    x[:4] = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 255.9, -1e-40])  # ties to even, carry, subnormal
    y = torch.empty(1024, dtype=torch.bfloat16)
    cast[(1,)](x, y)
    from areal_tik.verify.contract import compare_bits
    rep = compare_bits(y, x.bfloat16(), name="interpreter fp32->bf16 == torch RTNE")
    assert rep, rep.summary()


def run_cli(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "areal_tik.cli", *args], capture_output=True, text=True, env=e,
                          cwd=ROOT, timeout=600)


def test_env_json_reports_versions_backends_fingerprint():
    r = run_cli("env", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["versions"]["torch"] == torch.__version__
    assert set(info["backends"]) == {"triton", "cuda", "torch_ref", "fa3"}
    assert info["backends"]["torch_ref"]["available"] is True
    if not torch.cuda.is_available():
        assert info["gpu"] == "no GPU"
        assert info["backends"]["cuda"]["available"] is False and info["backends"]["cuda"]["reason"]
        assert info["backends"]["fa3"] == {"available": False, "reason": "no CUDA GPU"}
    assert len(info["fingerprint"]) == 16
    assert run_cli("--help").returncode == 0


def test_fingerprint_changes_with_environment():
    env = fingerprint.environment()
    ops = bind()
    a = fingerprint.compute(ops, env=env)["fingerprint"]
    assert fingerprint.compute(bind(), env=env)["fingerprint"] == a
    other = dict(env, gpu={"name": "x", "arch": "sm_90", "sms": 1})
    assert fingerprint.compute(ops, env=other)["fingerprint"] != a
    assert fingerprint.compute(ops, env=dict(env, triton="0.0"))["fingerprint"] != a


def test_fingerprint_hashes_the_bound_ops_and_never_selects(monkeypatch):
    """``compute`` reads the ``BoundOps`` it is given: a model's fingerprint is that of the ops patch_model bound
    to it even when the registry would now choose otherwise, and swapping one bound implementation changes it."""
    import dataclasses

    from areal_tik.layers.models import build_model
    from areal_tik.layers.patch import ops_of, patch_model
    env = fingerprint.environment()
    model = patch_model(build_model("tiny-qwen2", device="cpu", seed=0))
    ops = ops_of(model)
    want = fingerprint.compute(bind(), env=env)["fingerprint"]

    def refuse(*a, **k):
        raise AssertionError("compute selected an implementation")
    monkeypatch.setattr(registry, "select_impl", refuse)
    fp = fingerprint.compute(ops, env=env)
    assert fp["fingerprint"] == want and fp["selection"] == ops.selection
    # negative control: another implementation bound for one op is another fingerprint
    other = next(i for be, i in registry.implementations()["linear"].items() if be != ops.impls["linear"].backend)
    ops.impls = dict(ops.impls, linear=dataclasses.replace(other))
    assert fingerprint.compute(ops, env=env)["fingerprint"] != want


def test_explicit_backend_request_fails_loudly(monkeypatch):
    ops = registry.implementations()
    if not ops:
        pytest.skip("no ops registered yet")
    op = sorted(ops)[0]
    with pytest.raises(registry.BackendUnavailable):
        registry.parse_backend_spec("bogus")
    with pytest.raises(registry.BackendUnavailable):
        registry.select_impl(op, "no-such-backend")
    if not torch.cuda.is_available():
        with pytest.raises(registry.BackendUnavailable):
            registry.select_impl(op, "cuda")
    # the environment reaches selection only through the entry point's Settings, never per call
    default = registry.select_impl(op).backend
    monkeypatch.setenv(BACKEND_ENV, "torch_ref" if default != "torch_ref" else "triton")
    assert registry.select_impl(op).backend == default
    spec = Settings.from_env().backend
    assert spec == os.environ[BACKEND_ENV] and registry.select_impl(op, spec).backend == spec


def test_compile_checks_for_sm80_sm90_without_gpu():
    """Every Triton kernel compiles for sm_80/sm_90. (csrc/*.cu with nvcc -c for sm_80/sm_90a, with ptxas's
    verdicts: tests/kernels/test_cuda_build.py::test_csrc_compiles_for_sm80_and_sm90a; one nvcc pass per CI run.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "areal_tik.cli", "compile-check", "--skip-cuda", "--json"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=1500)
    out = json.loads(r.stdout)
    failures = [row for row in out["triton"] + out["cuda"] if not row["ok"]]
    assert not failures, json.dumps(failures, indent=1)[:4000]
    assert r.returncode == 0
    assert out["triton"], "compile-check compiled no Triton kernel (nothing was checked)"
    assert {row["arch"] for row in out["triton"]} == {"sm_80", "sm_90"}


def test_arch_preferred_backend_moves_the_attention_pair_together(monkeypatch):
    """On an architecture with a preferred backend for the attention pair, both ops take it when it is
    available and both fall back to DEFAULT_ORDER when it is not; an explicit request still wins."""
    ops = registry.implementations()
    pair = ("attention_varlen", "attention_paged")
    if not all(op in ops and {"triton", "cuda"} <= set(ops[op]) for op in pair):
        pytest.skip("the attention pair has no triton and cuda implementations here")
    assert set(registry.ARCH_PREFERRED.get("sm90", {})) >= set(pair)
    monkeypatch.setattr(registry, "_has_gpu", lambda: True)

    def fake(op, be, ok):
        i = ops[op][be]
        return dataclasses.replace(i, available=(lambda: (ok, "" if ok else "test: not here")))
    for arch, cuda_ok, expect in (("sm90", True, "cuda"), ("sm90", False, "triton"), ("sm80", True, "triton")):
        monkeypatch.setattr(registry, "_gpu_arch", lambda arch=arch: arch)
        for op in pair:
            monkeypatch.setitem(registry._REGISTRY[op], "cuda", fake(op, "cuda", cuda_ok))
            monkeypatch.setitem(registry._REGISTRY[op], "triton", fake(op, "triton", True))
        got = {op: registry.select_impl(op).backend for op in pair}
        assert got == {op: expect for op in pair}, (arch, cuda_ok, got)
        if cuda_ok:
            assert registry.select_impl(pair[0], "triton").backend == "triton"


def test_arch_preferred_backend_unavailable_warns_once(monkeypatch):
    """When sm90's preferred csrc attention cannot run, selection says so once (with the reason) and
    falls back; when it can run, nothing is logged."""
    ops = registry.implementations()
    pair = ("attention_varlen", "attention_paged")
    if not all(op in ops and {"triton", "cuda"} <= set(ops[op]) for op in pair):
        pytest.skip("the attention pair has no triton and cuda implementations here")
    monkeypatch.setattr(registry, "_has_gpu", lambda: True)
    monkeypatch.setattr(registry, "_gpu_arch", lambda: "sm90")
    monkeypatch.setattr(registry, "_WARNED_PREFERRED", set())
    for cuda_ok, n_warn in ((True, 0), (False, 1)):
        for op in pair:
            i = ops[op]
            monkeypatch.setitem(registry._REGISTRY[op], "cuda", dataclasses.replace(
                i["cuda"], available=(lambda ok=cuda_ok: (ok, "" if ok else "test: no nvcc"))))
            monkeypatch.setitem(registry._REGISTRY[op], "triton", dataclasses.replace(
                i["triton"], available=lambda: (True, "")))
        # A handler on the logger itself: other tests (AReaL's logging setup) may stop propagation to root.
        records = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append
        log = logging.getLogger("areal_tik.dispatch")
        log.addHandler(handler)
        monkeypatch.setattr(log, "disabled", False)
        monkeypatch.setattr(log, "level", logging.WARNING)
        try:
            for _ in range(3):
                for op in pair:
                    registry.select_impl(op)
        finally:
            log.removeHandler(handler)
        warns = [r for r in records if "prefers the cuda backend" in r.getMessage()]
        assert len(warns) == n_warn, (cuda_ok, [r.getMessage() for r in warns])
        if n_warn:
            assert "test: no nvcc" in warns[0].getMessage() and "attention_paged, attention_varlen" in warns[0].getMessage()


def test_an_op_that_calls_other_kernels_is_fingerprinted_with_their_sources(monkeypatch):
    """moe_experts runs the linear and silu_mul_packed kernels of its own backend (its module's ``USES``), so
    its fingerprint entry covers their sources on its own: with moe_experts the only op bound, an edit of the
    linear kernels' source changes the fingerprint. Negative control: moe_experts with its own package's
    sources only (no ``USES``) misses the same edit."""
    env = fingerprint.environment()
    impls = registry.implementations()
    ops = bind()
    experts = impls["moe_experts"]["triton"]
    ops.impls = {"moe_experts": experts}
    kernels_file = next(s for s in experts.sources if s.endswith(os.path.join("linear", "triton_kernels.py")))
    own_only = dataclasses.replace(experts, sources=tuple(
        s for s in experts.sources if os.path.dirname(s) == os.path.dirname(experts.sources[0])))
    narrow = bind()
    narrow.impls = {"moe_experts": own_only}
    before = [fingerprint.compute(o, env=env)["fingerprint"] for o in (ops, narrow)]
    real_read = fingerprint._read
    monkeypatch.setattr(fingerprint, "_read", lambda path: real_read(path) + (b"#" if path == kernels_file else b""))
    after = [fingerprint.compute(o, env=env)["fingerprint"] for o in (ops, narrow)]
    assert after[0] != before[0]
    assert after[1] == before[1]
