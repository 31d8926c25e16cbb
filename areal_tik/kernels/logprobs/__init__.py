"""The one log-prob function: ``logp = log_softmax(logits.float() / T)[token]`` (+ entropy).

Used by both the rollout sampler and the trainer loss (docs/design.md section 2).

Maths, per row i with ``z = logits[i].float() / T`` (correctly rounded division):
``lse = m + log(s)`` where the vocab is walked in fixed blocks of ``V_BLOCK`` columns at
absolute positions ``[0, V_BLOCK), [V_BLOCK, 2 V_BLOCK), ...`` in ascending order, each
block updating a running ``(m, s, t)``: ``m' = max(m, max(z_blk))``,
``s' = s * exp(m - m') + sum(exp(z_blk - m'))``, ``t' = t * exp(m - m') + sum(exp(z_blk - m') * z_blk)``.
``logp = z[token] - lse``; ``entropy = lse - t / s``.

Entry points:
- :func:`logprobs_from_logits` (``logits [T, V]`` bf16/fp16/fp32, unit last stride;
  tokens ``[T]`` int32/int64) -> fp32 ``[T]`` (and entropy ``[T]``).
- :func:`token_logprobs` (``hidden [T, K]``, ``lm_head_weight [V, K]``, same dtype,
  contiguous) -> fp32 ``[T]`` (and entropy): the lm_head GEMM (``linear``'s kernel) runs
  on vocab chunks of ``C`` columns (a multiple of V_BLOCK, ``T*C <= LOGITS_CHUNK_ELEMS``),
  each chunk's bf16 logits feeding the same block update. No fp32 logits are stored and
  at most ``T*C`` logits (x dtype) exist at once. **Bitwise equal** to
  ``logprobs_from_logits(linear(hidden, W), tokens, T)`` on the same backend: the chunk
  GEMM gives the same bits as the full GEMM (row- and tile-invariant ``linear``), and the
  block walk is the same kernel over the same absolute blocks whatever C is.

Accuracy vs :func:`logprobs_reference` (float64 from the same rounded logits): abs error
< 1e-4 per token for |logits|/T up to ~30.

Invariance: one row per program, fixed V_BLOCK and warps, so a row's bits do not depend
on T, its neighbours, its position, nor on C. torch_ref: the same block walk with
``_torch_math.exp/log`` and fixed pairwise trees inside a block (max is exact).

Backward (both entry points, both backends): w.r.t. logits, or hidden and weight
(chunked recompute of logits; ``dh`` accumulated in fp32 over chunks, ``dW`` per chunk):
``dz = g_logp * (onehot - p) - g_ent * p * (z - t/s)``, ``dlogits = dz / T``. Accurate,
not promised invariant.

Tokens must lie in ``[0, V)``: checked on CPU tensors; on the GPU an out-of-range token
gives NaN (never a silent wrong number).
"""
from __future__ import annotations

from areal_tik.kernels.logprobs.autograd import (
    logprobs_from_logits_torch, logprobs_from_logits_triton, token_logprobs_torch, token_logprobs_triton,
)
from areal_tik.kernels.logprobs.layout import LOGITS_CHUNK_ELEMS, LSE_WARPS, V_BLOCK
from areal_tik.kernels.logprobs.specs import compile_specs
from areal_tik.kernels.logprobs.torch_ref import logprobs_reference

__all__ = ["logprobs_from_logits_triton", "logprobs_from_logits_torch", "token_logprobs_triton",
           "token_logprobs_torch", "logprobs_reference", "V_BLOCK", "LOGITS_CHUNK_ELEMS", "OPS", "META",
           "COMPILE_SPECS"]

OPS = {
    "logprobs_from_logits": {"triton": logprobs_from_logits_triton, "torch_ref": logprobs_from_logits_torch},
    "token_logprobs": {"triton": token_logprobs_triton, "torch_ref": token_logprobs_torch},
}
META = {"logprobs.V_BLOCK": V_BLOCK, "logprobs.num_warps": LSE_WARPS, "logprobs.division": "div_rn by T"}

COMPILE_SPECS = compile_specs()
