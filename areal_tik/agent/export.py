"""Export the best verified version of a run back into the package, with provenance.

Writes ``areal_tik/kernels/exported/<op>_<arch>.py``: the version's source, then a
generated adapter (``EXPORT_META``, ``PROVENANCE``, ``ARCH``, an ``OPS`` table with the
public op signature and a torch backward). ``areal_tik/dispatch/registry.py`` registers
it as the op's implementation of the adapter's backend on a GPU of that architecture only;
the file is one of the implementation's sources, so the kernel fingerprint changes with it.
A JSON twin (``<op>_<arch>.json``) holds the meta-parameters, source and provenance. Provenance
records the agent store as a path relative to the directory holding the package (its file name
when it lies elsewhere), never an absolute path.
Adapters, by (op, kind):
- ``linear`` / ``triton``: the Triton source is the module's code; backend ``triton``.
- ``rms_norm`` / ``cuda_inline`` (the csrc root and its knob moves and transformations): the
  CUDA source is embedded as ``SOURCE`` with its C++ binding, JIT-built with its defines on
  first use (``load_inline``, csrc on the include path); backend ``cuda`` (selected where the
  rms_norm backend is cuda); bf16 only, other dtypes go to the csrc rms_norm as before.

Refused (:class:`ExportRefused`): runs timed with the SIMULATED timer, runs without a GPU
architecture, versions that are not verified, or a best version with any simulated
measurement.
"""
from __future__ import annotations

import json
import os
import time

from areal_tik.agent.kinds import BINDINGS
from areal_tik.agent.records import canonical_json

__all__ = ["ExportRefused", "export_best", "portable_path", "EXPORT_DIR"]

EXPORT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "exported")
# The directory holding the package (the repository root of a checkout): exports record paths relative to it.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ExportRefused(RuntimeError):
    pass


def portable_path(path: str | None) -> str | None:
    """``path`` as an export records it: relative to the directory holding the package (``bench/results/...``)
    when it lies below it, else its file name only. An export never records a machine's absolute path."""
    if not path:
        return path
    full = os.path.abspath(path)
    try:
        rel = os.path.relpath(full, _PACKAGE_ROOT)
    except ValueError:  # another drive
        return os.path.basename(full)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return os.path.basename(full)
    return rel.replace(os.sep, "/")


# What every adapter opens with, after the exported source: its op, arch, meta-parameters and provenance.
_ADAPTER_HEADER = '''

# ======================= areal-tik agent export adapter (generated) =======================
import torch as _torch

OP = {op!r}
ARCH = {arch!r}
EXPORT_META = {meta}
META = {{"agent_export": {hash!r}}}
PROVENANCE = {prov}
'''

_LINEAR_TRITON = _ADAPTER_HEADER + '''

class _ExportedLinear(_torch.autograd.Function):
    """Forward: the exported kernel (the contract above). Backward: plain torch matmuls
    in fp32 (the backward need not be batch-invariant)."""

    @staticmethod
    def forward(ctx, x2, weight, bias):
        out = _torch.empty(x2.shape[0], weight.shape[0], dtype=x2.dtype, device=x2.device)
        forward(x2, weight, bias, out, EXPORT_META)
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, g):
        x2, weight = ctx.saved_tensors
        gf = g.float()
        gx = (gf @ weight.float()).to(x2.dtype)
        gw = (gf.t() @ x2.float()).to(weight.dtype)
        gb = gf.sum(0).to(weight.dtype) if ctx.has_bias else None
        return gx, gw, gb


def linear_exported(x, weight, bias=None):
    """``linear(x, weight, bias=None)`` with the agent-exported kernel (see PROVENANCE)."""
    shp = x.shape
    x2 = x.reshape(-1, shp[-1]).contiguous()
    w = weight.contiguous()
    if x2.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad):
        y = _ExportedLinear.apply(x2, w, bias)
    else:
        y = _torch.empty(x2.shape[0], w.shape[0], dtype=x2.dtype, device=x2.device)
        forward(x2, w, bias, y, EXPORT_META)
    return y.reshape(*shp[:-1], w.shape[0])


OPS = {{OP: {{"triton": linear_exported}}}}
'''

# Every export of rms_norm repeats this adapter text by construction (kernels/exported/rms_norm_sm90.py is its
# output): the exported module must import nothing from the agent, so it carries its own copy.
_RMS_NORM_CUDA = _ADAPTER_HEADER + '''BINDING = {binding!r}
_ENTRY = None


def _entry():
    """The exported kernel's C++ entry, JIT-built from SOURCE with EXPORT_META's defines once per process."""
    global _ENTRY
    if _ENTRY is None:
        if _torch.version.cuda is None or not _torch.cuda.is_available():
            raise RuntimeError(f"{{OP}} (agent export {{META['agent_export'][:12]}}) needs a CUDA GPU")
        from torch.utils.cpp_extension import load_inline
        from areal_tik.kernels.cuda.loader import CSRC_DIR
        name = EXPORT_META.get("entry", "forward")
        defines = [f"-D{{k}}={{v}}" for k, v in sorted(EXPORT_META.get("defines", {{}}).items())]
        ext = load_inline(name="tik_export_" + META["agent_export"][:16], cpp_sources=[BINDING.replace("ENTRY", name)],
                          cuda_sources=[SOURCE], functions=[name], extra_cuda_cflags=["-O3", "-std=c++17", *defines],
                          extra_include_paths=[CSRC_DIR], verbose=False)
        _ENTRY = getattr(ext, name)
    return _ENTRY


def _forward(x2, w, eps):
    out = _torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
    _entry()(x2, w, out, float(eps))
    return out


class _ExportedRMSNorm(_torch.autograd.Function):
    """Forward: the exported kernel. Backward: the csrc rms_norm's (``cuda.elementwise.rms_norm_backward``)."""

    @staticmethod
    def forward(ctx, x2, w, eps):
        ctx.save_for_backward(x2, w)
        ctx.eps = eps
        return _forward(x2, w, eps)

    @staticmethod
    def backward(ctx, dy):
        from areal_tik.kernels.cuda.elementwise import rms_norm_backward
        x2, w = ctx.saved_tensors
        return (*rms_norm_backward(x2, w, ctx.eps, dy), None)


def rms_norm_exported(x, weight, eps, out=None):
    """``rms_norm(x, weight, eps)`` (HF semantics) with the agent-exported kernel for bf16 (see PROVENANCE);
    other dtypes, or an ``out`` buffer, run the csrc rms_norm."""
    from areal_tik.kernels.cuda.elementwise import rms_norm_cuda
    if x.dtype != _torch.bfloat16 or weight.dtype != _torch.bfloat16 or out is not None:
        return rms_norm_cuda(x, weight, eps, out=out)
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x {{tuple(x.shape)}} and weight {{tuple(weight.shape)}} need x[..., N], weight[N]")
    shp = x.shape
    x2 = x.reshape(-1, shp[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight.contiguous()
    if _torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _ExportedRMSNorm.apply(x2, w, float(eps)).reshape(shp)
    return _forward(x2, w, eps).reshape(shp)


OPS = {{OP: {{"cuda": rms_norm_exported}}}}
'''

# (op, kind) -> (adapter template, whether the source is Python code that opens the module)
_ADAPTERS = {("linear", "triton"): (_LINEAR_TRITON, True), ("rms_norm", "cuda_inline"): (_RMS_NORM_CUDA, False)}


def _arch_tag(arch: str) -> str:
    return arch.replace("_", "")


def export_best(store, run_name: str, out_dir: str | None = None) -> dict:
    run = store.run(run_name)
    if run is None:
        raise ExportRefused(f"no run named {run_name!r}")
    if run.timer != "gpu":
        raise ExportRefused(f"run {run_name!r} used the {run.timer.upper()} timer; simulated results are never exported")
    arch = ((run.env or {}).get("gpu") or {}).get("arch")
    if not arch:
        raise ExportRefused(f"run {run_name!r} recorded no GPU architecture")
    best = store.version(run.best_version)
    if best is None or best.status != "verified":
        raise ExportRefused("best version is not verified")
    meas = store.measurements(best.id)
    if any(m.simulated for m in meas):
        raise ExportRefused(f"version {best.id} has SIMULATED measurements; refusing")
    if (run.op, best.kind) not in _ADAPTERS:
        raise ExportRefused(f"no export adapter for op {run.op!r} with kind {best.kind!r}; adapters: {sorted(_ADAPTERS)}")
    checks = store.checks(best.id)
    wls = {w.id: w for w in store.workloads(run.id)}
    final = next((d for d in reversed(store.decisions(run.id)) if d.action == "stop"), None)
    lineage = [store.version(v) for v in store.lineage(best.id)]
    prov = {
        "run": run.name, "db": portable_path(store.path), "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "op": run.op, "kind": best.kind, "version_id": best.id, "version_hash": best.hash,
        "root_hash": store.version(run.root_version).hash, "contract_hash": store.contract(run.id).hash,
        "lineage": [{"id": v.id, "hash": v.hash, "description": v.description} for v in lineage],
        "checks": {"total": len(checks), "passed": sum(c.passed for c in checks)},
        "noise_floor": run.noise_floor, "env": run.env,
        "final": final.data if final else None,
        "latency_us": {wls[m.workload_id].name: m.latency_us for m in meas if m.workload_id in wls},
        "workloads": {w.name: {"shape": w.shape, "weight": w.weight} for w in wls.values()},
    }
    out_dir = out_dir or EXPORT_DIR
    os.makedirs(out_dir, exist_ok=True)
    init = os.path.join(out_dir, "__init__.py")
    if not os.path.exists(init):
        with open(init, "w") as f:
            f.write('"""Kernels exported by the optimization agent (`areal-tik agent export`)."""\n')
    stem = f"{run.op}_{_arch_tag(arch)}"
    header = (f"# Exported by `areal-tik agent export` from run {run.name!r}, version {best.id} "
              f"(hash {best.hash}), GPU arch {arch}. Do not edit by hand: re-export instead.\n")
    template, source_is_code = _ADAPTERS[(run.op, best.kind)]
    binding = None
    if best.kind == "cuda_inline":
        binding = BINDINGS[best.meta["binding"]]
    body = header + (best.source if source_is_code else f"SOURCE = {best.source!r}\n") + template.format(
        op=run.op, arch=arch, meta=repr(json.loads(canonical_json(best.meta))), hash=best.hash,
        prov=repr(json.loads(canonical_json(prov))), binding=binding)
    py = os.path.join(out_dir, stem + ".py")
    with open(py + ".tmp", "w") as f:
        f.write(body)
    os.replace(py + ".tmp", py)
    js = os.path.join(out_dir, stem + ".json")
    with open(js, "w") as f:
        json.dump({"op": run.op, "arch": arch, "kind": best.kind, "meta": best.meta, "source": best.source,
                   "provenance": prov}, f, indent=1, default=str)
    return {"py": py, "json": js, "version": best.id, "hash": best.hash, "arch": arch}
