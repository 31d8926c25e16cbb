"""Whether each backend (triton, cuda, torch_ref, fa3) can run on this machine, and why not: the one
availability table, read by the registry's selection and by ``areal-tik env``."""
from __future__ import annotations

import functools
from importlib import metadata

from areal_tik.kernels import interpreting

__all__ = ["status", "triton_status", "cuda_status", "torch_ref_status", "fa3_status"]


def status(backend: str) -> tuple[bool, str]:
    """``(ok, reason)`` of ``backend``. The per-backend functions are looked up when this runs, so a test can
    stand in for a machine's availability by replacing one of them."""
    table = {"triton": triton_status, "cuda": cuda_status, "torch_ref": torch_ref_status, "fa3": fa3_status}
    return table[backend]()


def torch_ref_status() -> tuple[bool, str]:
    return True, "pure PyTorch, runs on any device"


@functools.lru_cache(maxsize=None)
def triton_status() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except Exception as e:  # pragma: no cover
        return False, f"triton not importable: {e}"
    import torch  # lazy: keeps torch out of this module's import
    if torch.cuda.is_available():
        return True, f"triton {triton.__version__} on {torch.cuda.get_device_name()}"
    if interpreting():
        return True, f"triton {triton.__version__} CPU interpreter (TRITON_INTERPRET=1; slow, for tests)"
    return False, "no CUDA GPU (set TRITON_INTERPRET=1 to run Triton kernels on the CPU interpreter)"


@functools.lru_cache(maxsize=None)
def cuda_status() -> tuple[bool, str]:
    import torch  # lazy: keeps torch out of this module's import
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    if torch.version.cuda is None:
        return False, "torch is a CPU build"
    try:
        from areal_tik.kernels.cuda import loader as cuda_ext  # probe: a loader that fails to import is reported below
    except Exception as e:
        return False, f"cuda extension loader failed: {e}"
    return cuda_ext.status()


@functools.lru_cache(maxsize=None)
def fa3_status() -> tuple[bool, str]:
    """FlashAttention-3 as vLLM bundles it (``vllm.vllm_flash_attn``, the ``vllm`` extra): a CUDA GPU of compute
    capability 9.x and an importable vLLM whose FA3 supports it. Imports vLLM only where a GPU is present."""
    import torch  # lazy: keeps torch out of this module's import
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    try:
        # optional dependency (vllm): imported only on this path
        from vllm.vllm_flash_attn import flash_attn_interface as fa
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to report, not to raise
        return False, (f"vLLM's FlashAttention is not importable ({type(e).__name__}: {e}); "
                       "install the vllm extra: pip install 'areal-tik[vllm]'")
    if not fa.is_fa_version_supported(3):
        return False, f"FlashAttention-3 cannot run here: {fa.fa_version_unsupported_reason(3)}"
    return True, f"FlashAttention-3 from vLLM {metadata.version('vllm')} on {torch.cuda.get_device_name()}"
