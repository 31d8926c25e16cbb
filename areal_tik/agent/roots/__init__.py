"""Root kernels the agent can start from: op -> (kind, template file, initial meta).

A root is deliberately naive but contract-correct. To add one (decode attention, a
``cuda_inline`` csrc kernel), drop its template here, add a task in ``tasks.py`` and an
entry below.
"""
from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))

ROOTS = {
    "linear": {
        "kind": "triton",
        "file": "linear_naive.py",
        # one bucket for every M: small square tiles, no pipelining to speak of.
        "meta": {"buckets": [{"max_m": None, "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1,
                              "num_warps": 4, "num_stages": 2}]},
    },
}


def load_root(op: str) -> tuple[str, str, dict]:
    """(kind, source text, meta) of the root for ``op``."""
    if op not in ROOTS:
        raise KeyError(f"no root kernel for op {op!r}; known: {sorted(ROOTS)}")
    r = ROOTS[op]
    with open(os.path.join(HERE, r["file"])) as f:
        src = f.read()
    import copy
    return r["kind"], src, copy.deepcopy(r["meta"])
