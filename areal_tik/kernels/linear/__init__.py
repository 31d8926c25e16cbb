"""Row-invariant linear layer: ``y = x @ W^T (+ b)``, one reduction schedule for every M.

Maths: ``y[m, n] = round_to(x.dtype)( sum_k x[m, k] * W[n, k]  (+ b[n]) )`` with the sum
accumulated in fp32; bias added in fp32 before the single rounding.

Shapes/dtypes: x ``[..., K]`` (bf16, fp16 or fp32, unit stride in the last dim; a 2-D x
may have any row stride), W ``[N, K]`` contiguous, same dtype, b ``[N]`` or None. Output
``[..., N]`` in x's dtype, contiguous. fp32 inputs use exact fp32 products (``ieee``,
no TF32).

Accuracy: relative Frobenius error against :func:`linear_reference` (float64) below
``1e-2`` for bf16 (a final bf16 rounding dominates, ~2e-3 typical), ``1e-5`` for fp32.

Invariance (triton backend): output row m depends only on x[m], W and b, bit for bit —
not on M, on the other rows, on where row m sits in the batch, on padding rows, on N (a
stacked weight or a slice of the rows gives the same columns). K is cut into a fixed number
of chunks that depends on K alone (:mod:`.splits`; one chunk for most K); each chunk of an
output tile is reduced as ``acc = tl.dot(x_tile, w_tile^T, acc)`` over its K in ascending
BLOCK_K=64 steps from a fresh fp32 accumulator, and the chunk sums are added to +0.0 in
ascending order (one chunk: its sum alone), either in the tile's program or, in the split kernel (one program per tile and
chunk, for decode-sized M on narrow outputs), by the tile's last program to finish
(fp32 partials through a workspace: the same adds, the same bits). The tile sizes in M and N (and warps,
stages, K-loop unrolling) are chosen per problem size from :data:`CONFIGS`; on the H200
with Triton 3.6 that form has been measured bit-identical across such tiles, and
``tests/kernels/test_linear.py::test_gpu_all_configs_bit_identical`` proves it for every
config in the table on the GPU it runs on. Tiles come through plain pointer loads, TMA
descriptors (sm_90+; a pointer twin runs when a row stride is not 16-byte aligned) or a
persistent TMA kernel — the same dot chain per output tile in each. Which config runs for
(arch, N, K, M) comes from ``linear_tuned.json`` in this package when it has a rule
(written by ``bench/tune_linear.py``, every entry bit-checked there and by the GPU test;
its hash is in META), else from :func:`default_config_name` (on sm_90+ a TMA tile sized for enough programs at
decode-sized M and the persistent TMA kernel on large outputs; pointer kernels otherwise). Under the
CPU interpreter one fixed config is used (the interpreter's numpy matmul is *not*
tile-shape invariant).

torch_ref backend: the same row invariance on any device, from a loop over K of
``acc = acc + x[:, k] * W[:, k]`` (separately rounded fp32 ops, ascending k). Its bits
differ from the triton backend's; the contract holds within one backend.

Backward (both backends): ``dx = dy @ W``, ``dW = dy^T @ x``, ``db = sum dy`` with
torch matmuls (fp32 accumulation); gradients are accurate but not promised invariant.
"""
from __future__ import annotations

import hashlib

from areal_tik.kernels.linear.configs import (BLOCK_K, CONFIGS, DECODE_MIN_PROGRAMS, DECODE_TMA_TILES,
                                             PERSISTENT_MIN_TILES)
from areal_tik.kernels.linear.launcher import linear_fwd, linear_triton
from areal_tik.kernels.linear.selection import (
    TABLE_TEXT, config_name_for, config_names, pick_config, row_grid, tile_configs,
)
from areal_tik.kernels.linear.specs import compile_specs
from areal_tik.kernels.linear.splits import K_SPLITS, k_split
from areal_tik.kernels.linear.torch_ref import linear_reference, linear_torch

__all__ = ["linear_triton", "linear_torch", "linear_reference", "linear_fwd", "pick_config", "config_name_for",
           "config_names", "row_grid", "tile_configs", "CONFIGS", "OPS", "META", "COMPILE_SPECS", "TILE_CONFIGS",
           "K_SPLITS", "k_split"]

OPS = {"linear": {"triton": linear_triton, "torch_ref": linear_torch}}
# the implementations that compile one kernel per tile config: what precompilation launches them with
TILE_CONFIGS = {"linear": {"triton": tile_configs}}
META = {"linear.BLOCK_K": BLOCK_K,
        "linear.form": "acc=tl.dot(a,b^T,acc) ascending K per fixed K chunk, fp32 acc, chunk sums ascending",
        "linear.k_splits": ",".join(f"{k}:{s}" for k, s in sorted(K_SPLITS.items())) or "none",
        "linear.torch_ref": "ascending-k fp32 mul+add",
        # the tuned tile table and the built-in rule pick among configs proven bit-identical, but they are
        # fingerprinted anyway
        "linear.tuned_table": hashlib.sha256(TABLE_TEXT.encode()).hexdigest()[:16] if TABLE_TEXT else "none",
        "linear.default_rule": f"8<M<=256 on sm_90+: {'/'.join(DECODE_TMA_TILES.values())}, "
                               f">= {DECODE_MIN_PROGRAMS} programs; M>256: tmap128_n256_flat from "
                               f"{PERSISTENT_MIN_TILES} tiles"}

COMPILE_SPECS = compile_specs()
