"""The fixed split of K: how many chunks a reduction of length K is cut into (bit-defining).

A split of K that depends only on K keeps the linear op row-invariant: every output element is
``((0 + p_0) + p_1) + ...`` (with one chunk: ``p_0`` alone) where chunk ``p_c`` covers ``[c * chunk, (c + 1) * chunk)`` of K, each
reduced by the ascending BLOCK_K dot chain from a fresh fp32 accumulator, whatever M is and whatever
kernel form runs (the chunks in one program, or one program per chunk with the sums added by the
tile's last program). It depends on K only, not on N, so a stacked GEMM (q/k/v, gate/up) keeps the
separate projections' bits, and the log-prob head's vocabulary chunks keep the unchunked bits.

:data:`K_SPLITS` maps K to the number of chunks; K absent -> one chunk (the plain chain). Its value is
part of the op's META, so it is in the fingerprint.
"""
from __future__ import annotations

from areal_tik.kernels.linear.configs import BLOCK_K

#: K -> chunks, picked by measurement (bench/probes/probe_split_linear.py): a split pays where the output has
#: too few tiles at decode M to keep every SM streaming weights (the down projections: N 3584 / 1536 at
#: K 18944 / 8960); at K 3584 and 1536 the outputs sharing that K (q/k/v, o, gate/up, lm_head) lose more
#: on the wide GEMMs than they gain on the narrow ones.
K_SPLITS: dict[int, int] = {18944: 2, 8960: 2}


def k_split(K: int, splits: int | None = None) -> tuple[int, int]:
    """``(chunks, chunk)`` for a reduction of length ``K``: ``chunk`` is a multiple of BLOCK_K and no
    chunk is empty. ``splits`` overrides :data:`K_SPLITS` (tests and probes)."""
    s = K_SPLITS.get(K, 1) if splits is None else int(splits)
    if s < 1:
        raise ValueError(f"splits must be >= 1, got {s}")
    k = max(K, 1)
    chunk = -(-(-(-k // s)) // BLOCK_K) * BLOCK_K
    return -(-k // chunk), chunk
