"""Compile every Triton kernel and every ``csrc/*.cu`` for sm_80 and sm_90 without a GPU.

Kernel modules list ``COMPILE_SPECS``: dicts with ``fn`` (a ``@triton.jit`` function),
``signature`` (arg name -> Triton type string, e.g. ``"*bf16"``, ``"i32"``),
``constexprs`` and optional ``num_warps``/``num_stages``/``enable_fp_fusion`` (as the kernel is launched) and ``attrs`` (ASTSource
argument attributes, ``{(i,): [["tt.divisibility", 16]]}``, as Triton specialises at launch). Must run with
``TRITON_INTERPRET`` unset (the interpreter replaces jit functions); the tests call it in
a subprocess. CUDA sources are compiled with ``nvcc -c`` for sm_80 and sm_90a, with ptxas's
resource report parsed per kernel (registers, spill bytes) and its performance warnings kept (e.g.
C7511: wgmma instructions serialized), so CI catches a kernel change that would cost speed on a GPU
it does not have. The torch binding (``csrc/*.cpp``) gets a host-compiler syntax check against torch's
headers (``-fsyntax-only``; a CPU-only torch wheel lacks one generated c10/cuda header, which a stub
stands in for), so a binding error shows up before a GPU machine builds the extension.
"""
from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
import time

from areal_tik.kernels import interpreting, op_modules
from areal_tik.kernels.cuda.loader import sources

TRITON_ARCHS = (80, 90)
NVCC_ARCHS = ("80", "90a")


EXTRA_KERNEL_MODULES = ("areal_tik.layers.weights_digest",)  # Triton kernels outside areal_tik.kernels


def triton_specs():
    for name in (*op_modules(), *EXTRA_KERNEL_MODULES):
        mod = importlib.import_module(name)
        for spec in getattr(mod, "COMPILE_SPECS", ()):
            yield name.rsplit(".", 1)[-1], spec


def compile_triton(archs=TRITON_ARCHS) -> list[dict]:
    if interpreting():
        raise RuntimeError("compile checks need TRITON_INTERPRET unset")
    # lazy: keeps triton out of this module's import
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    rows = []
    for modname, spec in triton_specs():
        fn = spec["fn"]
        for cc in archs:
            t0 = time.time()
            row = {"module": modname, "kernel": fn.__name__, "arch": f"sm_{cc}", "constexprs": dict(spec["constexprs"])}
            try:
                # optional "attrs": argument specialisations as at launch, e.g. tt.divisibility 16
                src = ASTSource(fn=fn, signature=dict(spec["signature"]), constexprs=dict(spec["constexprs"]),
                                attrs=spec.get("attrs"))
                opts = {k: spec[k] for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in spec}
                k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=opts)
                row.update(ok=True, cubin_bytes=len(k.asm["cubin"]), shared=k.metadata.shared,
                           n_regs=getattr(k, "n_regs", None))
            except Exception as e:  # report, do not hide
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
            row["seconds"] = round(time.time() - t0, 2)
            rows.append(row)
    return rows


def parse_ptxas(text: str) -> tuple[dict, list[str]]:
    """``ptxas -v`` output -> ({mangled kernel: {"regs", "spill_stores", "spill_loads", "stack"}},
    [performance/other warnings, one line each])."""
    kernels, cur = {}, None
    for line in text.splitlines():
        m = re.search(r"(?:Compiling entry function '|Function properties for )([^\s']+)", line)
        if m:  # the kernel the following lines describe
            cur = kernels.setdefault(m.group(1), {})
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur is not None:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and cur is not None:
            cur["regs"] = int(m.group(1))
    warnings = [ln.strip() for ln in text.splitlines()
                if "Performance Loss" in ln or re.search(r"\bwarning\b", ln, re.IGNORECASE)]
    return kernels, warnings


def nvcc_object(nvcc: str, src: str, arch: str, out_dir: str, flags: list[str]) -> dict:
    """``nvcc -c src`` for sm_<arch> (ptxas -v) into out_dir: {"ok", "kernels" (parse_ptxas), "ptxas_warnings",
    "error" when it failed}. ``flags``: include paths, defines."""
    cmd = [nvcc, "-c", src, "-o", os.path.join(out_dir, "x.o"), "-std=c++17", "-O3",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", "--expt-relaxed-constexpr", "-Xptxas", "-v", *flags]
    r = subprocess.run(cmd, capture_output=True, text=True)
    kernels, warnings = parse_ptxas(r.stdout + "\n" + r.stderr)
    return {"ok": r.returncode == 0, "kernels": kernels, "ptxas_warnings": warnings,
            **({} if r.returncode == 0 else {"error": (r.stderr or r.stdout)[-1500:]})}


def compile_cuda(archs=NVCC_ARCHS) -> list[dict]:
    nvcc = shutil.which("nvcc")
    rows = []
    srcs = [s for s in sources() if s.endswith(".cu")]
    if not srcs:
        return rows
    if nvcc is None:
        return [{"source": os.path.basename(s), "ok": False, "error": "nvcc not found"} for s in srcs]
    import torch.utils.cpp_extension as ext  # lazy: CUDA-only (compiles or loads the extension)
    incs = []
    for p in ext.include_paths():
        incs += ["-I", p]
    incs += ["-I", sysconfig.get_paths()["include"]]
    with tempfile.TemporaryDirectory() as d:
        for s in srcs:
            for a in archs:
                t0 = time.time()
                res = nvcc_object(nvcc, s, a, d, incs)
                rows.append({"source": os.path.basename(s), "arch": f"sm_{a}", "ok": res.pop("ok"),
                             "seconds": round(time.time() - t0, 1), **res})
        rows += _check_binding_syntax(nvcc, incs, d)
    return rows


def _cuda_include_dir(nvcc: str, tmp: str) -> str | None:
    """The toolkit's include directory: the root nvcc's own dry run names (nvcc may be a wrapper script),
    else CUDA_HOME / CUDA_PATH, /usr/local/cuda, or next to nvcc."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
             os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    probe = os.path.join(tmp, "probe.cu")
    with open(probe, "w") as f:
        f.write("\n")
    r = subprocess.run([nvcc, "--dryrun", "-c", probe, "-o", os.path.join(tmp, "probe.o")], capture_output=True,
                       text=True)
    m = re.search(r"\bTOP=(\S+)", r.stdout + r.stderr)
    if m:
        cands.insert(0, m.group(1))
    for c in cands:
        if c and os.path.exists(os.path.join(c, "include", "cuda_runtime.h")):
            return os.path.join(c, "include")
    return None


def _check_binding_syntax(nvcc: str, incs: list[str], tmp: str) -> list[dict]:
    """``c++ -fsyntax-only`` of every csrc/*.cpp with torch's, Python's and the CUDA toolkit's headers."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    cpps = [s for s in sources() if s.endswith(".cpp")]
    if not cpps:
        return []
    if cxx is None:
        return [{"source": os.path.basename(s), "arch": "host", "ok": False, "error": "no C++ compiler"} for s in cpps]
    cuda_inc = _cuda_include_dir(nvcc, tmp)
    if cuda_inc is None:
        return [{"source": os.path.basename(s), "arch": "host", "ok": False,
                 "error": "CUDA toolkit headers (cuda_runtime.h) not found next to nvcc or in CUDA_HOME"} for s in cpps]
    stub_root = os.path.join(tmp, "stub_include")
    macros = os.path.join("c10", "cuda", "impl", "cuda_cmake_macros.h")
    extra = []
    if not any(os.path.exists(os.path.join(incs[i + 1], macros)) for i in range(0, len(incs), 2)):
        os.makedirs(os.path.dirname(os.path.join(stub_root, macros)), exist_ok=True)
        with open(os.path.join(stub_root, macros), "w") as f:
            f.write("#pragma once\n")  # generated at torch's CUDA build; empty is enough for a syntax check
        extra = ["-I", stub_root]
    rows = []
    for s in cpps:
        t0 = time.time()
        cmd = [cxx, "-fsyntax-only", "-std=c++17", "-DTORCH_EXTENSION_NAME=tik_syntax_check", "-w", s, *incs, *extra,
               "-I", cuda_inc, "-I", os.path.dirname(s)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        rows.append({"source": os.path.basename(s), "arch": "host", "ok": r.returncode == 0,
                     "seconds": round(time.time() - t0, 1), "kernels": {}, "ptxas_warnings": [],
                     **({} if r.returncode == 0 else {"error": (r.stderr or r.stdout)[-1500:]})})
    return rows
