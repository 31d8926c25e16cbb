"""The GPU architecture name used to key tuned tables and exported kernels."""
from __future__ import annotations


def gpu_arch_name() -> str | None:
    """``"sm90"``-style name of the current CUDA device, or None without a GPU."""
    try:
        import torch  # lazy: keeps torch out of this module's import
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm{major}{minor}"
    except Exception:  # pragma: no cover
        pass
    return None
