"""areal-tik: one set of kernels for AReaL's rollout and training, so rollout log-probs
equal training log-probs bit for bit and the recompute pass can be skipped."""
from areal_tik.contract import Report

__version__ = "0.1.0"

__all__ = ["Report", "__version__"]
