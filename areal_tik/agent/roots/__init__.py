"""Root kernels the agent can start from: op -> (kind, source, initial meta).

A root is contract-correct; it need not be fast. Two sources:

- ``file``: a template in this directory (``linear``: a deliberately naive Triton GEMM).
- ``csrc``: a file of the package's ``csrc/`` as it stands (``rms_norm``: ``tik_elementwise.cu``, the
  cuda backend's RMSNorm, with its build-time knob ``TIK_RMS_WARPS`` as the meta-parameter and the
  ``rms_norm`` C++ binding of ``kinds.BINDINGS`` as its entry point). A run records the text it
  started from, so later csrc edits do not change an existing run's root.

To add one (decode attention, another csrc kernel), add a task in ``tasks.py`` and an entry below.
Export (``agent export``) has an adapter for ``linear`` only; for a csrc root it refuses, and the best
version's knobs (``agent show``) are what csrc/ would adopt.
"""
from __future__ import annotations

import copy
import os

from areal_tik.kernels.cuda.loader import CSRC_DIR

HERE = os.path.dirname(os.path.abspath(__file__))

ROOTS = {
    "linear": {
        "kind": "triton",
        "file": "linear_naive.py",
        # one bucket for every M: small square tiles, no pipelining to speak of.
        "meta": {"buckets": [{"max_m": None, "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1,
                              "num_warps": 4, "num_stages": 2}]},
    },
    "rms_norm": {
        "kind": "cuda_inline",
        "csrc": "tik_elementwise.cu",
        "meta": {"entry": "tik_agent_rms_norm", "binding": "rms_norm", "defines": {"TIK_RMS_WARPS": 4}},
    },
}


def root_path(op: str) -> str:
    """The file a root's source is read from."""
    r = ROOTS[op]
    if "csrc" in r:
        return os.path.join(CSRC_DIR, r["csrc"])
    return os.path.join(HERE, r["file"])


def load_root(op: str) -> tuple[str, str, dict]:
    """(kind, source text, meta) of the root for ``op``."""
    if op not in ROOTS:
        raise KeyError(f"no root kernel for op {op!r}; known: {sorted(ROOTS)}")
    path = root_path(op)
    if not os.path.exists(path):
        raise FileNotFoundError(f"root source for {op!r} not found at {path} (csrc/ ships with the package)")
    with open(path) as f:
        src = f.read()
    r = ROOTS[op]
    return r["kind"], src, copy.deepcopy(r["meta"])
