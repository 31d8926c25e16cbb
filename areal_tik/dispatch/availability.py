"""Whether the triton and cuda backends can run on this machine, and why not."""
from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=None)
def triton_status() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except Exception as e:  # pragma: no cover
        return False, f"triton not importable: {e}"
    import torch
    if torch.cuda.is_available():
        return True, f"triton {triton.__version__} on {torch.cuda.get_device_name()}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, f"triton {triton.__version__} CPU interpreter (TRITON_INTERPRET=1; slow, for tests)"
    return False, "no CUDA GPU (set TRITON_INTERPRET=1 to run Triton kernels on the CPU interpreter)"


@functools.lru_cache(maxsize=None)
def cuda_status() -> tuple[bool, str]:
    import torch
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    if torch.version.cuda is None:
        return False, "torch is a CPU build"
    try:
        from areal_tik.kernels.cuda import loader as cuda_ext
    except Exception as e:
        return False, f"cuda extension loader failed: {e}"
    return cuda_ext.status()
