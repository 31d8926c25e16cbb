"""The routed experts of an MoE layer: for each token and each of its k experts, the expert's gated MLP.

Maths, for token t and rank r with expert ``e = topk_ids[t, r]`` (weights as HF stores them:
``w_gate_up [E, 2I, H]``, gate rows first, then up; ``w_down [E, H, I]``)::

    y[t, r] = linear( silu_mul_packed( linear(x[t], w_gate_up[e]) ), w_down[e] )

with the backend's own ``linear`` forward (``kernels/linear``) and ``silu_mul_packed`` (``kernels/swiglu``):
their rounding points (fp32 accumulation, each GEMM output and the activation rounded to x's dtype). Returns
``y [T, k, H]`` in x's dtype.

How it runs. triton (:func:`experts_triton`): no host sync, so a forward can be captured in a CUDA graph. The
assignments ``a = t*k + r`` are sorted by expert on the device and cut into blocks of a static-size table
(:mod:`.grouped_linear`); one grouped GEMM launch writes ``h[a] = silu_mul_packed(linear(x[t], w_gate_up[e]))``
for all T*k assignments (the activation in the GEMM's epilogue up to BLOCK_M 64; at the prefill tile the GEMM
writes ``[T*k, 2I]`` and ``silu_mul_packed`` runs on it: the same bits), and a second grouped launch writes
``y[a] = linear(h[a], w_down[e])``. Both launches have grids fixed by T*k, E and the widths, never by the
routing. Each grouped row is reduced exactly as the linear op reduces a row (its own dot chain and fixed K
split), so it has the bits of ``linear_fwd`` on that row alone. torch_ref (:func:`experts_torch`): the
assignments grouped by expert on the host (:func:`expert_groups`: a stable sort, so within an expert in
ascending ``a``; one host sync for the per-expert counts), each expert's tokens gathered and run through the
two GEMMs as one batch, the results written back to their assignments.

Invariance: ``y[t, r]`` depends only on ``x[t]`` and expert e's weights, bit for bit: not on which other tokens
went to the same expert, how many, in what order, or on T. That is the linear op's row invariance (a row's
result never depends on M or on the other rows) and the elementwise activation: ``y[t, r]`` equals the linear
op on the single row ``x[t:t+1]`` with ``w_gate_up[e]``, then ``silu_mul_packed``, then the linear op with
``w_down[e]``, on the same backend.

Shapes/dtypes: x ``[T, H]``, weights of x's dtype (bf16, fp16, fp32), ids ``[T, k]`` int32/int64 in ``[0, E)``,
all contiguous. Accuracy vs :func:`experts_reference` (float64): relative Frobenius error below 1e-2 (bf16),
1e-5 (fp32). Host syncs: none in the triton forward (:data:`HOST_SYNC_FREE` lists it); the torch_ref forward
and the backward (both backends) wait on the host for the per-expert counts.

Backward (both backends, torch math, deterministic): per expert the recomputed activations, ``dW_down[e]``,
``dW_gate_up[e]`` from fp32 matmuls, the SiLU-mul backward at HF's rounding points, each assignment's ``dx`` row
written once, then a token's k rows added in rank order. Accurate, not promised invariant.
"""
from __future__ import annotations

import torch

from areal_tik.kernels.linear.torch_ref import matmul_invariant_torch
from areal_tik.kernels.moe.checks import validate_experts
from areal_tik.kernels.moe.grouped_linear import FUSED_SILU_MAX_BLOCK_M, grouped_linear
from areal_tik.kernels.moe.routing import routing_plan
from areal_tik.kernels.swiglu import silu_mul_packed_torch, silu_mul_packed_triton

__all__ = ["experts_triton", "experts_torch", "experts_reference", "expert_groups", "experts_triton_fwd",
           "HOST_SYNC_FREE"]


def expert_groups(topk_ids: torch.Tensor, num_experts: int):
    """``[(e, assignments, tokens)]`` for every expert with work: the flat assignments ``t*k + r`` routed to
    ``e`` (ascending) and their tokens. One host sync (the per-expert counts)."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    groups, start = [], 0
    for e, c in enumerate(counts):
        if c:
            a = order[start:start + c]
            groups.append((e, a, a // k))
            start += c
    return groups


def _experts_fwd(linear, act, x, w_gate_up, w_down, topk_ids):
    T, H = x.shape
    k = topk_ids.shape[1]
    y = torch.empty((T * k, H), dtype=x.dtype, device=x.device)
    for e, a, tok in expert_groups(topk_ids, w_gate_up.shape[0]):
        rows = x.index_select(0, tok)
        y.index_copy_(0, a, linear(act(linear(rows, w_gate_up[e])), w_down[e]))
    return y.view(T, k, H)


def _linear_torch(x2, w):
    return matmul_invariant_torch(x2, w).to(x2.dtype)     # the torch_ref linear forward without a bias


def experts_triton_fwd(x, w_gate_up, w_down, topk_ids) -> torch.Tensor:
    """The triton forward without argument checks or autograd (as ``linear_fwd`` is the linear op's): the plan, the
    gate/up grouped GEMM with its activation (fused up to :data:`FUSED_SILU_MAX_BLOCK_M`), the down grouped GEMM;
    no host sync."""
    T, H = x.shape
    k = topk_ids.shape[1]
    plan = routing_plan(topk_ids, w_gate_up.shape[0])
    if plan.block_m <= FUSED_SILU_MAX_BLOCK_M:                        # decode and mixed steps: one launch, same bits
        h = grouped_linear(x, w_gate_up, plan, row_div=k, silu=True)  # [T*k, I], row a from x[a // k]
    else:
        h = silu_mul_packed_triton(grouped_linear(x, w_gate_up, plan, row_div=k))
    y = grouped_linear(h, w_down, plan, row_div=1)
    return y.view(T, k, H)


def _fwd_torch(x, w_gate_up, w_down, topk_ids):
    return _experts_fwd(_linear_torch, silu_mul_packed_torch, x, w_gate_up, w_down, topk_ids)


def _experts_backward(needs, x, w_gate_up, w_down, topk_ids, dy):
    T, H = x.shape
    k = topk_ids.shape[1]
    I = w_down.shape[2]
    dt = x.dtype
    dyf = dy.reshape(T * k, H).float()
    dx_a = torch.zeros((T * k, H), dtype=torch.float32, device=x.device) if needs[0] else None
    dwgu = torch.zeros(w_gate_up.shape, dtype=torch.float32, device=x.device) if needs[1] else None
    dwd = torch.zeros(w_down.shape, dtype=torch.float32, device=x.device) if needs[2] else None
    for e, a, tok in expert_groups(topk_ids, w_gate_up.shape[0]):
        rows = x.index_select(0, tok).float()
        wgu, wd = w_gate_up[e].float(), w_down[e].float()
        gu = (rows @ wgu.t()).to(dt).float()
        g, u = gu[:, :I], gu[:, I:]
        sig = torch.sigmoid(g)
        s = (g * sig).to(dt).float()
        d = dyf.index_select(0, a)
        if dwd is not None:
            dwd[e] = d.t() @ (s * u).to(dt).float()
        dh = (d @ wd).to(dt).float()
        ds = (dh * u).to(dt).float()
        dgu = torch.cat([(ds * (sig * (1.0 + g * (1.0 - sig)))).to(dt).float(), (dh * s).to(dt).float()], 1)
        if dwgu is not None:
            dwgu[e] = dgu.t() @ rows
        if dx_a is not None:
            dx_a.index_copy_(0, a, dgu @ wgu)
    dx = None
    if dx_a is not None:
        per_rank = dx_a.view(T, k, H)
        acc = per_rank[:, 0]
        for r in range(1, k):                 # rank order
            acc = acc + per_rank[:, r]
        dx = acc.to(dt)
    return (dx, None if dwgu is None else dwgu.to(w_gate_up.dtype), None if dwd is None else dwd.to(w_down.dtype))


class _ExpertsFn(torch.autograd.Function):
    """Either forward; one deterministic torch backward."""

    @staticmethod
    def forward(ctx, fwd, x, w_gate_up, w_down, topk_ids):
        ctx.save_for_backward(x, w_gate_up, w_down, topk_ids)
        return fwd(x, w_gate_up, w_down, topk_ids)

    @staticmethod
    def backward(ctx, dy):
        x, w_gate_up, w_down, topk_ids = ctx.saved_tensors
        return (None, *_experts_backward(ctx.needs_input_grad[1:4], x, w_gate_up, w_down, topk_ids, dy), None)


def _experts(fwd, x, w_gate_up, w_down, topk_ids, triton_path):
    validate_experts(x, w_gate_up, w_down, topk_ids, triton_path)
    if torch.is_grad_enabled() and (x.requires_grad or w_gate_up.requires_grad or w_down.requires_grad):
        return _ExpertsFn.apply(fwd, x, w_gate_up, w_down, topk_ids)
    with torch.no_grad():
        return fwd(x, w_gate_up, w_down, topk_ids)


def experts_triton(x, w_gate_up, w_down, topk_ids) -> torch.Tensor:
    """``y [T, k, H]``: each token's k expert outputs through grouped GEMMs with the Triton linear op's row
    reduction and the Triton SiLU-mul; the forward never waits on the host (CUDA-graph capturable)."""
    return _experts(experts_triton_fwd, x, w_gate_up, w_down, topk_ids, True)


def experts_torch(x, w_gate_up, w_down, topk_ids) -> torch.Tensor:
    """The same on the torch_ref linear and SiLU-mul (any device); a per-expert loop that waits on the host."""
    return _experts(_fwd_torch, x, w_gate_up, w_down, topk_ids, False)


def experts_reference(x, w_gate_up, w_down, topk_ids) -> torch.Tensor:
    """float64 ``down(silu(gate(x)) * up(x))`` per (token, rank)."""
    I = w_down.shape[2]
    wgu = w_gate_up.double()[topk_ids]                  # [T, k, 2I, H]
    gu = torch.einsum("th,tkih->tki", x.double(), wgu)
    g, u = gu[..., :I], gu[..., I:]
    h = g * torch.sigmoid(g) * u
    return torch.einsum("tki,tkhi->tkh", h, w_down.double()[topk_ids])


#: the experts implementations whose forward never waits on the host: ``layers/moe.host_synced`` asks this
HOST_SYNC_FREE = frozenset({experts_triton})
