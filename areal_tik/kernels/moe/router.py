"""The MoE router after its GEMM: fp32 softmax over a token's expert logits, top-k, optional renormalisation.

Maths, per token row ``z = logits[t].float()`` (the router GEMM's logits in the model dtype, as HF rounds
them): ``p = softmax(z)`` in fp32 (``m = max z``, ``e = exp(z - m)``, ``s = sum e``, ``p = e / s``); the top-k
experts by ``p``, largest first, **ties broken by the lower expert index**; weights ``w_r = p[id_r]``, and with
``norm_topk_prob`` ``w_r = p[id_r] / (w_0 + w_1 + ... + w_{k-1})`` with the sum taken in rank order. Returns
fp32 weights ``[T, k]`` and int64 expert ids ``[T, k]`` (rank order).

Shapes/dtypes: logits ``[T, E]`` (bf16, fp16 or fp32), contiguous, ``1 <= E <= 1024``, ``1 <= k <= E``. Ids always
lie in ``[0, E)``: a row whose logits are not all finite (a CUDA graph's padding rows, a capture's warm-up on
stale buffers) gets expert ``E - 1`` at every rank (its weights are meaningless), so the experts op never
indexes past E; a finite row's ids are unaffected (some entry always equals the maximum).
Accuracy vs :func:`route_reference` (float64 softmax, a stable descending sort): the same ids except where two
probabilities lie within fp32 rounding of each other; weights within 1e-6 relative.

Invariance: a token's ids and weights depend only on its own logits row: one row per program (Triton) or
row-wise torch ops (torch_ref), every reduction over a row in a fixed order that depends on E alone, so a
token alone, in any batch, at any position gets the same bits. torch_ref: ``exp`` from ``_torch_math`` (exactly
rounded operations), the sum ``s`` sequential in ascending expert order, max/compare exact. Triton: its own
``exp`` and a ``tl.sum`` tree fixed by ``BLOCK_E = next_pow2(E)``, ``div_rn`` divisions; the two backends' bits
differ, each is consistent with itself.

Backward (both backends, torch math, deterministic): through the weights to the logits (ids are not
differentiable): ``dsel = (dw - sum(dw * w)) / S`` under renormalisation (else ``dw``), scattered into the
chosen experts' probabilities, then the softmax backward ``dz = p * (dp - sum(dp * p))``, rounded to the logits'
dtype. Accurate, not promised invariant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from areal_tik.kernels import _torch_math as tm
from areal_tik.kernels.moe.checks import validate_route

__all__ = ["route_triton", "route_torch", "route_reference"]


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_t, K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    z = tl.load(logits_ptr + t * stride_t + offs, mask=mask, other=float("-inf")).to(tl.float32)
    m = tl.max(z, axis=0)
    e = tl.where(mask, tl.exp(z - m), 0.0)
    s = tl.sum(e, axis=0)
    p = tl.math.div_rn(e, tl.zeros_like(e) + s)
    sel = tl.where(mask, p, -1.0)
    ks = tl.arange(0, BLOCK_K)
    vals = tl.zeros([BLOCK_K], dtype=tl.float32)
    idxs = tl.zeros([BLOCK_K], dtype=tl.int32)
    for r in tl.static_range(K):
        v = tl.max(sel, axis=0)
        # ties: the lowest expert index; a non-finite row (no lane equals v) gets E - 1
        i = tl.minimum(tl.min(tl.where(sel == v, offs, BLOCK_E), axis=0), E - 1)
        vals = tl.where(ks == r, v, vals)
        idxs = tl.where(ks == r, i, idxs)
        sel = tl.where(offs == i, -2.0, sel)
    if NORM:
        total = tl.sum(tl.where(ks == 0, vals, 0.0), axis=0)
        for r in tl.static_range(1, K):                                 # rank order
            total = total + tl.sum(tl.where(ks == r, vals, 0.0), axis=0)
        vals = tl.math.div_rn(vals, tl.zeros_like(vals) + total)
    kmask = ks < K
    tl.store(w_ptr + t * K + ks, vals, mask=kmask)
    tl.store(ids_ptr + t * K + ks, idxs.to(tl.int64), mask=kmask)


def _route_triton_fwd(logits: torch.Tensor, top_k: int, norm: bool):
    T, E = logits.shape
    w = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, w, ids, E, logits.stride(0), K=top_k, BLOCK_E=triton.next_power_of_2(E),
                            BLOCK_K=triton.next_power_of_2(top_k), NORM=bool(norm), num_warps=1)
    return w, ids


def _route_torch_fwd(logits: torch.Tensor, top_k: int, norm: bool):
    T, E = logits.shape
    z = logits.float()
    e = tm.exp(z - z.amax(-1, keepdim=True))
    s = e[:, 0]
    for j in range(1, E):                      # ascending expert order
        s = s + e[:, j]
    sel = e / s[:, None]
    experts = torch.arange(E, device=logits.device)
    vals, ids = [], []
    for _ in range(top_k):
        v = sel.amax(-1, keepdim=True)
        # ties: the lowest expert index; a non-finite row (no entry equals v) gets E - 1
        i = torch.where(sel == v, experts, E).amin(-1).clamp(max=E - 1)
        vals.append(v[:, 0])
        ids.append(i)
        sel = sel.scatter(1, i[:, None], -1.0)
    w = torch.stack(vals, 1) if vals else z.new_empty((T, 0))
    if norm:
        total = w[:, 0]
        for r in range(1, top_k):              # rank order
            total = total + w[:, r]
        w = w / total[:, None]
    return w.contiguous(), torch.stack(ids, 1).to(torch.int64).contiguous()


class _RouteFn(torch.autograd.Function):
    """Either forward; one torch backward through the weights to the logits."""

    @staticmethod
    def forward(ctx, fwd, logits, top_k, norm):
        w, ids = fwd(logits, top_k, norm)
        ctx.save_for_backward(logits, w, ids)
        ctx.norm = norm
        ctx.mark_non_differentiable(ids)
        return w, ids

    @staticmethod
    def backward(ctx, dw, _dids):
        logits, w, ids = ctx.saved_tensors
        p = torch.softmax(logits.float(), -1)
        dw = dw.float()
        if ctx.norm:
            S = p.gather(1, ids).sum(-1, keepdim=True)
            dsel = (dw - (dw * w).sum(-1, keepdim=True)) / S
        else:
            dsel = dw
        dp = torch.zeros_like(p).scatter(1, ids, dsel)        # a row's ids are distinct: no accumulation
        dz = p * (dp - (dp * p).sum(-1, keepdim=True))
        return None, dz.to(logits.dtype), None, None


def _route(fwd, logits, top_k, norm_topk_prob, triton_path):
    validate_route(logits, top_k, triton_path)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _RouteFn.apply(fwd, logits, top_k, bool(norm_topk_prob))
    with torch.no_grad():
        return fwd(logits, top_k, bool(norm_topk_prob))


def route_triton(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32 [T, k], ids int64 [T, k])`` of each token's top-k experts, one Triton program per token."""
    return _route(_route_triton_fwd, logits, top_k, norm_topk_prob, True)


def route_torch(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from exactly rounded torch ops in a fixed order (any device)."""
    return _route(_route_torch_fwd, logits, top_k, norm_topk_prob, False)


def route_reference(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax; ids by a stable descending sort (ties: lower index first); float64 weights."""
    p = torch.softmax(logits.double(), -1)
    ids = torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = p.gather(1, ids)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w, ids
