"""Loader for the CUDA extension built from ``csrc/``.

``setup.py`` builds ``areal_tik.kernels.cuda._C`` when a CUDA toolkit and a CUDA build of torch are
present. Otherwise :func:`load` compiles the installed sources just in time with
``torch.utils.cpp_extension.load`` (needs nvcc). :func:`status` says which, or why
neither works.
"""
from __future__ import annotations

import functools
import glob
import logging
import os
import shutil

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CSRC_DIR = os.path.join(_REPO, "csrc")


def sources() -> list[str]:
    return sorted(glob.glob(os.path.join(CSRC_DIR, "*.cu")) + glob.glob(os.path.join(CSRC_DIR, "*.cpp")))


@functools.lru_cache(maxsize=None)
def load():
    """The compiled module (prebuilt ``areal_tik.kernels.cuda._C`` or a JIT build). Raises on failure."""
    try:
        from areal_tik.kernels.cuda import _C  # type: ignore[attr-defined]
        return _C
    except ImportError:
        pass
    srcs = sources()
    if not srcs:
        raise RuntimeError(f"no CUDA sources under {CSRC_DIR}")
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        raise RuntimeError("areal_tik.kernels.cuda._C not built and nvcc not found for a JIT build")
    from torch.utils.cpp_extension import load as _load  # lazy: CUDA-only (compiles or loads the extension)
    import torch  # lazy: keeps torch out of this module's import
    logging.getLogger("areal_tik.cuda_ext").info(
        "areal-tik: loading the csrc extension just in time (first build on this machine: ~1 min of nvcc; "
        "cached under torch's extensions directory afterwards; pip install -e . builds it ahead of time)")
    cc = torch.cuda.get_device_capability()
    arch = f"{cc[0]}{cc[1]}" + ("a" if cc == (9, 0) else "")
    flags = ["-O3", "-DNO_FAST_MATH",
             f"-gencode=arch=compute_{arch},code=sm_{arch}", "-std=c++17"]
    return _load(name="areal_tik_C", sources=srcs, extra_cuda_cflags=flags, extra_cflags=["-O3"], verbose=False)


def status() -> tuple[bool, str]:
    try:
        mod = load()
    except Exception as e:
        return False, str(e).splitlines()[0][:200]
    kernel = "mma.sync"
    if getattr(mod, "wgmma_prefill_available", None) is not None and mod.wgmma_prefill_available():
        kernel = "wgmma + TMA (sm_90a, D=128; mma.sync otherwise)"
    return True, f"loaded {getattr(mod, '__file__', mod)}; attention prefill kernel: {kernel}"
