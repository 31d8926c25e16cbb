"""Kernel kinds: how the agent turns (source text, meta-parameters) into a callable.

The agent never imports kernel code itself; the evaluator's worker process does, through
a :class:`KernelKind`. Every kind yields an object with the task's entry point
(``forward(*task_args, meta)``), so tasks and checks do not care what language the
kernel is written in.

- ``triton``: the source is a Python module (written to a content-addressed file so
  Triton's JIT can read its text) defining ``forward``.
- ``cuda_inline``: the source is CUDA C++, compiled with ``torch.utils.cpp_extension.load_inline``
  (``csrc/`` on the include path, so a csrc file is a valid source as it stands);
  ``meta["defines"]`` become ``-D`` flags (the meta-parameters). The Python entry point
  ``meta["entry"]`` comes either from the source itself (``void <entry>(x, w, bias, out)`` on
  ``torch::Tensor``s, ``bias`` possibly empty: the linear signature) or, when
  ``meta["binding"]`` names one of :data:`BINDINGS`, from that C++ binding, which wraps a
  plain-CUDA ``extern "C"`` function of the source (how a csrc kernel becomes a root:
  ``agent/roots``). Needs nvcc and a CUDA build of torch to run; :meth:`CudaInlineKind.compile_check`
  compiles a source with ``nvcc -c`` on any machine with nvcc (CI checks the roots that way).

Known code transformations edit regions marked ``# <tik:NAME>`` ... ``# </tik:NAME>``
(``//`` comments in C++), see :func:`replace_region`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile

from areal_tik.kernels.cuda.loader import CSRC_DIR
from areal_tik.dispatch.compile_check import nvcc_object

__all__ = ["KernelKind", "TritonKind", "CudaInlineKind", "BINDINGS", "KINDS", "get_kind", "regions", "replace_region"]

_REGION = re.compile(r"(?P<indent>[ \t]*)(?P<c>#|//) <tik:(?P<name>[\w-]+)>\n(?P<body>.*?)[ \t]*(?P=c) </tik:(?P=name)>",
                     re.S)


def regions(source: str) -> dict[str, str]:
    """name -> body text of every ``<tik:name>`` region in ``source``."""
    return {m.group("name"): m.group("body") for m in _REGION.finditer(source)}


def replace_region(source: str, name: str, body: str) -> str:
    """Replace the body of region ``name`` (re-indented to the marker's indentation).

    ``body`` is written without leading indentation; raises KeyError when the region is
    missing (the transformation does not apply to this source).
    """
    for m in _REGION.finditer(source):
        if m.group("name") != name:
            continue
        ind, c = m.group("indent"), m.group("c")
        lines = [(ind + ln if ln.strip() else "") for ln in body.strip("\n").split("\n")]
        new = f"{ind}{c} <tik:{name}>\n" + "\n".join(lines) + f"\n{ind}{c} </tik:{name}>"
        return source[:m.start()] + new + source[m.end():]
    raise KeyError(f"source has no <tik:{name}> region")


class KernelKind:
    name = "?"

    def load(self, source: str, meta: dict, key: str, workdir: str):
        raise NotImplementedError


class TritonKind(KernelKind):
    name = "triton"

    def load(self, source: str, meta: dict, key: str, workdir: str):
        d = os.path.join(workdir, "kernels")
        os.makedirs(d, exist_ok=True)
        modname = f"tik_cand_{key}"
        path = os.path.join(d, modname + ".py")
        if not os.path.exists(path):
            tmp = path + f".{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(source)
            os.replace(tmp, path)
        if modname in sys.modules:
            return sys.modules[modname]
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(modname, None)
            raise
        if not callable(getattr(mod, "forward", None)):
            raise AttributeError("kernel source defines no callable forward(...)")
        return mod


# C++ bindings for csrc roots: name -> template (ENTRY = the Python name). Each wraps a plain-CUDA
# extern "C" function of csrc (no torch headers in the kernel source, so nvcc alone compiles it).
BINDINGS = {
    "rms_norm": r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
extern "C" int tik_rms_norm(const void* x, const void* w, void* y, int64_t rows, int n, int64_t x_row_stride,
                            float eps, int dtype, cudaStream_t stream);
void ENTRY(torch::Tensor x, torch::Tensor w, torch::Tensor out, double eps) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && out.is_cuda(), "rms_norm: CUDA tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, n] with unit last stride");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "rms_norm: bf16 only");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(), "rms_norm: w must be [n]");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous(), "rms_norm: out must be a contiguous [rows, n]");
  const int err = tik_rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.size(0), (int)x.size(1), x.stride(0),
                               (float)eps, 0, at::cuda::getCurrentCUDAStream(x.device().index()).stream());
  TORCH_CHECK(err == 0, "tik_rms_norm failed with CUDA error ", err);
}
""",
}

_LINEAR_DECL = ("#include <torch/extension.h>\n"
                "void {entry}(torch::Tensor x, torch::Tensor w, torch::Tensor bias, torch::Tensor out);")


def _csrc_dir() -> str:
    return CSRC_DIR


class CudaInlineKind(KernelKind):
    name = "cuda_inline"

    class _Loaded:
        def __init__(self, ext, entry):
            self._fn = getattr(ext, entry)

        def forward(self, *args):
            """``forward(*tensors_and_scalars, meta)``: the task's arguments in the entry's order (a None
            tensor, e.g. no bias, becomes an empty tensor); returns the entry's result."""
            import torch  # lazy: keeps torch out of this module's import
            *vals, _meta = args
            like = next(v for v in vals if isinstance(v, torch.Tensor))
            vals = [torch.empty(0, device=like.device, dtype=like.dtype) if v is None else v for v in vals]
            return self._fn(*vals)

    @staticmethod
    def _cpp(meta: dict) -> str:
        entry = meta.get("entry", "forward")
        b = meta.get("binding")
        if b is None:
            return _LINEAR_DECL.format(entry=entry)
        if b not in BINDINGS:
            raise KeyError(f"cuda_inline: unknown binding {b!r}; known: {sorted(BINDINGS)}")
        return BINDINGS[b].replace("ENTRY", entry)

    @staticmethod
    def _defines(meta: dict) -> list[str]:
        return [f"-D{k}={v}" for k, v in sorted(meta.get("defines", {}).items())]

    def load(self, source: str, meta: dict, key: str, workdir: str):
        import torch  # lazy: keeps torch out of this module's import
        if torch.version.cuda is None or not torch.cuda.is_available():
            raise RuntimeError("cuda_inline kernels need a CUDA GPU and a CUDA build of torch "
                               f"(this torch: {torch.__version__}, CUDA available: {torch.cuda.is_available()})")
        from torch.utils.cpp_extension import load_inline  # lazy: CUDA-only (compiles or loads the extension)
        entry = meta.get("entry", "forward")
        cpp = self._cpp(meta)
        name = "tik_cuda_" + hashlib.sha256((key + source + cpp).encode()).hexdigest()[:12]
        build = os.path.join(workdir, "cuda_build", name)
        os.makedirs(build, exist_ok=True)
        ext = load_inline(name=name, cpp_sources=[cpp], cuda_sources=[source], functions=[entry],
                          extra_cuda_cflags=["-O3", "-std=c++17", *self._defines(meta)],
                          extra_include_paths=[_csrc_dir()], build_directory=build, verbose=False)
        return self._Loaded(ext, entry)

    def compile_check(self, source: str, meta: dict, arch: str = "90a", workdir: str | None = None) -> dict:
        """``nvcc -c`` of the CUDA source with the meta's defines (no GPU, no torch headers needed for a
        csrc-style source), as CI compiles csrc (backend.compile_check.nvcc_object): {"ok", "arch", "ptxas"
        (registers/spills per kernel), "ptxas_warnings", "error"}."""
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            return {"ok": False, "arch": arch, "error": "nvcc not found"}
        with tempfile.TemporaryDirectory(dir=workdir) as d:
            src = os.path.join(d, "cand.cu")
            with open(src, "w") as f:
                f.write(source)
            res = nvcc_object(nvcc, src, arch, d, ["-I", _csrc_dir(), *self._defines(meta)])
        return {"arch": arch, "ptxas": res.pop("kernels"), **res}


KINDS: dict[str, KernelKind] = {k.name: k for k in (TritonKind(), CudaInlineKind())}


def get_kind(name: str) -> KernelKind:
    try:
        return KINDS[name]
    except KeyError:
        raise KeyError(f"unknown kernel kind {name!r}; known: {sorted(KINDS)}") from None
