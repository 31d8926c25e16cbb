"""CUDA C++ backend (csrc/) on a CPU: every csrc/*.cu compiles for sm_80 and sm_90a (``areal-tik compile-check``,
ptxas verdicts included), the cuda ops are registered with every csrc file as a source, and the constants, the
single decode path and the launch arguments agree between kernels/cuda and csrc (a stale build is refused)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from areal_tik.kernels.cuda import elementwise as cuda_elementwise, extension as cuda_extension

sys.path.insert(0, os.path.dirname(__file__))
from cuda_helpers import ROOT, attn  # noqa: E402  (tests/kernels/cuda_helpers.py)


def test_csrc_compiles_for_sm80_and_sm90a(csrc_compile_check):
    import shutil
    # Not a skip: this is the suite's only nvcc pass, and CI must compile every .cu (install a CUDA toolkit).
    assert shutil.which("nvcc") is not None, "nvcc not found: the csrc compile check needs a CUDA toolkit"
    # `areal-tik compile-check --skip-triton --json`, started with the first kernel test (tests/kernels/conftest.py)
    stdout, _ = csrc_compile_check.result(timeout=900)
    info = json.loads(stdout)
    rows = {(c["source"], c["arch"]): c for c in info["cuda"]}
    every_cu = sorted(f for f in os.listdir(os.path.join(ROOT, "csrc")) if f.endswith(".cu"))
    assert {"tik_attention.cu", "tik_attention_prefill.cu", "tik_attention_decode.cu", "tik_elementwise.cu"} <= set(every_cu)
    for src in every_cu:  # every csrc/*.cu, for both architectures (the CI compile check)
        for arch in ("sm_80", "sm_90a"):
            row = rows.get((src, arch))
            assert row is not None, f"{src} {arch} not compiled"
            assert row["ok"], f"{src} {arch}: {row.get('error')}"
            # ptxas's own verdicts on speed: no serialized wgmma (C7511) or other performance warning
            assert not [w for w in row["ptxas_warnings"] if "Performance Loss" in w], row["ptxas_warnings"]
    # the torch binding: a host-compiler syntax check against torch's headers
    row = rows.get(("tik_bindings.cpp", "host"))
    assert row is not None, "tik_bindings.cpp not syntax-checked"
    assert row["ok"], f"tik_bindings.cpp: {row.get('error')}"
    # The sm_90a prefill kernel: no spills, and inside the register budget it was measured at (a
    # change that pushes it to 255 registers or spills has cost speed every time so far).
    wg = {n: k for n, k in rows[("tik_attention_prefill.cu", "sm_90a")]["kernels"].items() if "attn_kernel_wgmma" in n}
    assert wg, "attn_kernel_wgmma missing from the sm_90a ptxas report"
    for name, k in wg.items():
        assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (name, k)
        assert k["regs"] <= 240, (name, k)


def test_cuda_ops_registered_with_sources():
    from areal_tik.dispatch import registry
    impls = registry.implementations()
    for op in ("attention_varlen", "attention_paged", "kv_cache_write", "rms_norm", "apply_rope"):
        info = impls[op]["cuda"]
        assert any(s.endswith("tik_attention.cu") for s in info.sources)
        # the fingerprint hashes every csrc file, headers included
        every = {f for f in os.listdir(os.path.join(ROOT, "csrc")) if f.endswith((".h", ".cuh", ".cu", ".cpp"))}
        assert every <= {os.path.basename(s) for s in info.sources}, every
        assert dict(info.meta)["cuda.attn.BLOCK_N"] == 64
    src = open(os.path.join(ROOT, "csrc", "tik_api.h")).read()
    assert (f"#define TIK_ATTN_BLOCK_N {cuda_extension.BLOCK_N} " in src
            and f"#define TIK_ATTN_SPLIT {cuda_extension.SPLIT} " in src)


def test_decode_merge_argument_cpu():
    """decode_merge: "fused" / "kernel" / None (the module default, "fused"); anything else is
    refused before any CUDA call. The binding takes it."""
    import inspect
    cu = attn()
    assert cu.DECODE_MERGE == "fused"
    assert inspect.signature(cu.attention_paged_cuda).parameters["decode_merge"].default is None
    assert cu._decode_merge("fused") == 0 and cu._decode_merge("kernel") == 1
    with pytest.raises(ValueError, match="decode_merge"):
        cu._decode_merge("both")
    b = open(os.path.join(ROOT, "csrc", "tik_bindings.cpp")).read()
    assert 'py::arg("decode_merge") = 0' in b and "p.counters = counters.data_ptr<int>()" in b
    a = open(os.path.join(ROOT, "csrc", "tik_attention_decode.cu")).read()
    assert "attn_decode_kernel<D, true, true, STAGES, HALF, TMA>" in a and "atomicExch(ctr, 0)" in a


def test_single_decode_path_cpu():
    """The decode variant switch is gone on both sides: no variant plumbing in kernels/cuda, no
    variant field/define in csrc, and the extension version marker agrees."""
    import inspect
    cu = attn()
    for gone in ("DECODE_VARIANTS", "CUDA_DECODE_VARIANT", "_variant"):
        for mod in (cu, cuda_extension, cuda_elementwise):
            assert not hasattr(mod, gone), (mod.__name__, gone)
    for fn in (cu.attention_varlen_cuda, cu.attention_paged_cuda):
        assert "variant" not in inspect.signature(fn).parameters
    assert "cuda.attn.decode_variant" not in cuda_extension.META and "cuda.attn.decode" in cuda_extension.META
    api = open(os.path.join(ROOT, "csrc", "tik_api.h")).read()
    assert f"#define TIK_ATTN_DECODE_PATH {cuda_extension.DECODE_PATH}\n" in api
    srcs = {f: open(os.path.join(ROOT, "csrc", f)).read() for f in sorted(os.listdir(os.path.join(ROOT, "csrc")))
            if f.startswith(("tik_api", "tik_attention", "tik_bindings"))}
    for f, text in srcs.items():
        for gone in ("TIK_ATTN_DECODE_VARIANTS", "int variant", "p->variant", "p.variant", 'py::arg("variant")',
                     "_v2"):
            assert gone not in text, f"{f} still has {gone!r}"
    cu_src = "".join(t for f, t in srcs.items() if f.startswith("tik_attention"))
    assert "attn_decode_kernel" in cu_src and "attn_decode_merge_kernel" in cu_src
    assert "launch<D, 1," not in cu_src  # no 1-warp attn_kernel launch left
    assert 'm.attr("DECODE_PATH") = TIK_ATTN_DECODE_PATH;' in srcs["tik_bindings.cpp"]


def test_stale_extension_rejected_cpu(monkeypatch):
    """An extension built before the single decode path (it exported DECODE_VARIANTS and would
    run the removed 1-warp decode by default) is refused with a rebuild message."""
    import types
    from areal_tik.kernels.cuda import loader as cuda_ext
    cx = cuda_extension
    stale = types.SimpleNamespace(BLOCK_N=cx.BLOCK_N, SPLIT=cx.SPLIT, DECODE_VARIANTS=2, __file__="stale.so")
    monkeypatch.setattr(cuda_ext, "load", lambda: stale)
    with pytest.raises(RuntimeError, match="rebuild"):
        cx.extension()
    no_pk = types.SimpleNamespace(BLOCK_N=cx.BLOCK_N, SPLIT=cx.SPLIT, DECODE_PATH=cx.DECODE_PATH, __file__="old.so")
    monkeypatch.setattr(cuda_ext, "load", lambda: no_pk)
    with pytest.raises(RuntimeError, match="prefill_kernel"):  # built before the wgmma prefill selector
        cx.extension()
    no_ew = types.SimpleNamespace(BLOCK_N=cx.BLOCK_N, SPLIT=cx.SPLIT, DECODE_PATH=cx.DECODE_PATH,
                                  PREFILL_KERNELS=cx.PREFILL_KERNELS, __file__="old.so")
    monkeypatch.setattr(cuda_ext, "load", lambda: no_ew)
    with pytest.raises(RuntimeError, match="RoPE backward"):  # apply_rope_fwd without the backward flag
        cx.extension()
    fresh = types.SimpleNamespace(BLOCK_N=cx.BLOCK_N, SPLIT=cx.SPLIT, DECODE_PATH=cx.DECODE_PATH,
                                  PREFILL_KERNELS=cx.PREFILL_KERNELS, ELEMENTWISE_API=cx.ELEMENTWISE_API)
    monkeypatch.setattr(cuda_ext, "load", lambda: fresh)
    assert cx.extension() is fresh
    with open(os.path.join(ROOT, "csrc", "tik_api.h")) as f:
        assert f"#define TIK_ELEMENTWISE_API {cx.ELEMENTWISE_API}\n" in f.read()


def test_prefill_kernel_argument_cpu():
    """prefill_kernel: "auto" / "mma" / "wgmma" / None (the module default, "auto"); anything else is
    refused before any CUDA call; csrc and the binding agree."""
    import inspect
    cu = attn()
    assert cuda_extension.PREFILL_KERNEL == "auto"
    for fn in (cu.attention_varlen_cuda, cu.attention_paged_cuda):
        assert inspect.signature(fn).parameters["prefill_kernel"].default is None
    assert (cu._prefill_kernel("auto"), cu._prefill_kernel("mma"), cu._prefill_kernel("wgmma")) == (0, 1, 2)
    with pytest.raises(ValueError, match="prefill_kernel"):
        cu._prefill_kernel("cutlass")
    api = open(os.path.join(ROOT, "csrc", "tik_api.h")).read()
    assert f"#define TIK_ATTN_PREFILL_KERNELS {cuda_extension.PREFILL_KERNELS}\n" in api
    assert "TIK_ATTN_PREFILL_AUTO = 0, TIK_ATTN_PREFILL_MMA = 1, TIK_ATTN_PREFILL_WGMMA = 2" in api
    b = open(os.path.join(ROOT, "csrc", "tik_bindings.cpp")).read()
    assert b.count('py::arg("prefill_kernel") = 0') == 2 and "p.prefill_kernel = (int)prefill_kernel;" in b
    assert "cuda.attn.prefill" in cuda_extension.META
