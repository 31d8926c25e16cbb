"""Kernel kinds: how the agent turns (source text, meta-parameters) into a callable.

The agent never imports kernel code itself; the evaluator's worker process does, through
a :class:`KernelKind`. Every kind yields an object with the task's entry point
(``forward(*task_args, meta)``), so tasks and checks do not care what language the
kernel is written in.

- ``triton``: the source is a Python module (written to a content-addressed file so
  Triton's JIT can read its text) defining ``forward``.
- ``cuda_inline``: the source is CUDA C++ defining ``void <entry>(x, w, bias, out)`` on
  ``torch::Tensor`` arguments (``bias`` may be an empty tensor); ``meta["defines"]``
  become ``-D`` flags (the meta-parameters), compiled with
  ``torch.utils.cpp_extension.load_inline``. Needs nvcc on a GPU host; untested on the
  CPU machine this was written on.

Known code transformations edit regions marked ``# <tik:NAME>`` ... ``# </tik:NAME>``
(``//`` comments in C++), see :func:`replace_region`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys

__all__ = ["KernelKind", "TritonKind", "CudaInlineKind", "KINDS", "get_kind", "regions", "replace_region"]

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


class CudaInlineKind(KernelKind):
    name = "cuda_inline"

    class _Loaded:
        def __init__(self, ext, entry):
            self._fn = getattr(ext, entry)

        def forward(self, x, w, bias, out, meta):
            import torch
            self._fn(x, w, bias if bias is not None else torch.empty(0, device=x.device, dtype=x.dtype), out)
            return out

    def load(self, source: str, meta: dict, key: str, workdir: str):
        from torch.utils.cpp_extension import load_inline
        entry = meta.get("entry", "forward")
        defines = [f"-D{k}={v}" for k, v in sorted(meta.get("defines", {}).items())]
        decl = f"#include <torch/extension.h>\nvoid {entry}(torch::Tensor x, torch::Tensor w, torch::Tensor bias, torch::Tensor out);"
        name = "tik_cuda_" + hashlib.sha256((key + source).encode()).hexdigest()[:12]
        build = os.path.join(workdir, "cuda_build", name)
        os.makedirs(build, exist_ok=True)
        ext = load_inline(name=name, cpp_sources=[decl], cuda_sources=[source], functions=[entry],
                          extra_cuda_cflags=["-O3", "-std=c++17", *defines], build_directory=build, verbose=False)
        return self._Loaded(ext, entry)


KINDS: dict[str, KernelKind] = {k.name: k for k in (TritonKind(), CudaInlineKind())}


def get_kind(name: str) -> KernelKind:
    try:
        return KINDS[name]
    except KeyError:
        raise KeyError(f"unknown kernel kind {name!r}; known: {sorted(KINDS)}") from None
