"""areal-tik: one set of kernels for AReaL's rollout and training, so rollout log-probs
equal training log-probs bit for bit and the recompute pass can be skipped."""
from areal_tik.verify.contract import Report

__version__ = "0.1.0"

__all__ = ["Report", "patch_model", "__version__"]


def __getattr__(name: str):
    # lazy: importing areal_tik must not import transformers or the kernels
    if name == "patch_model":
        from areal_tik.layers.patch import patch_model
        return patch_model
    raise AttributeError(f"module 'areal_tik' has no attribute {name!r}")
