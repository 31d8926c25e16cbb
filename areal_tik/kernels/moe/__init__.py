"""Mixture-of-experts ops under the contract: router, routed experts, combine, gated shared expert.

Three places make an MoE layer's output depend on the batch in common implementations, and each op here
fixes one of them (docs/design.md, "Mixture of experts"):

- ``moe_route`` (:mod:`.router`): fp32 softmax over a token's expert logits, top-k with ties broken by the
  lower expert index, the top-k weights renormalised in rank order when ``norm_topk_prob``; one token's
  row at a time. (The router's GEMM is the ``linear`` op.)
- ``moe_experts`` (:mod:`.experts`): each (token, rank)'s expert MLP through the batch-invariant ``linear``
  and ``silu_mul_packed`` of the same backend: a token's result never depends on which other tokens share its
  expert. The triton backend runs the GEMMs as grouped launches with static grids (:mod:`.grouped_linear`),
  no host sync; the torch_ref backend loops over the experts on the host.
- ``moe_combine`` (:mod:`.combine`): a token's k expert outputs times their weights, summed in fp32 in rank
  order, rounded once; ``moe_shared_add``: Qwen2-MoE's sigmoid-gated shared expert added at HF's rounding
  points.

Each module states its maths, shapes, accuracy bound and invariance, holds its float64 reference and its
autograd (a deterministic torch backward); the argument checks are :mod:`.checks`.
"""
from __future__ import annotations

from areal_tik.kernels.moe.combine import (
    BLOCK_H, combine_reference, combine_torch, combine_triton, shared_add_reference, shared_add_torch,
    shared_add_triton,
)
from areal_tik.kernels.moe.experts import (
    HOST_SYNC_FREE, expert_groups, experts_reference, experts_torch, experts_triton, experts_triton_fwd,
)
from areal_tik.kernels.moe.grouped_linear import compile_specs as grouped_compile_specs, token_counts_per_tile
from areal_tik.kernels.moe.routing import compile_specs as routing_compile_specs
from areal_tik.kernels.moe.router import _route_kernel, route_reference, route_torch, route_triton
from areal_tik.kernels.moe.combine import _combine_kernel, _shared_add_kernel   # noqa: F401  (compile specs)

__all__ = ["route_triton", "route_torch", "route_reference", "experts_triton", "experts_torch", "experts_reference",
           "expert_groups", "experts_triton_fwd", "HOST_SYNC_FREE", "combine_triton", "combine_torch",
           "combine_reference", "shared_add_triton", "shared_add_torch", "shared_add_reference", "OPS", "META",
           "USES", "COMPILE_SPECS", "TILE_CONFIGS"]

OPS = {
    "moe_route": {"triton": route_triton, "torch_ref": route_torch},
    "moe_experts": {"triton": experts_triton, "torch_ref": experts_torch},
    "moe_combine": {"triton": combine_triton, "torch_ref": combine_torch},
    "moe_shared_add": {"triton": shared_add_triton, "torch_ref": shared_add_torch},
}
# what precompilation launches the triton experts at: one token count per grouped-GEMM tile
# (``token_counts_per_tile(num_experts, top_k, min_tokens, max_tokens)``); torch_ref compiles nothing
TILE_CONFIGS = {"moe_experts": {"triton": token_counts_per_tile}}
# moe_experts runs the linear and silu_mul_packed kernels of its own backend, whatever a model binds for
# those ops: their sources are part of its numerics
USES = ("areal_tik.kernels.linear", "areal_tik.kernels.swiglu")
META = {"moe.route": "fp32 softmax, top-k ties to lower index, renorm sum in rank order",
        "moe.experts": "per assignment: linear + silu_mul_packed + linear of the same backend (triton: grouped "
                       "GEMM on the linear op's chain and k_split)",
        "moe.combine": f"fp32 acc += w*y in rank order, no fma, BLOCK_H={BLOCK_H}",
        "moe.shared_add": "routed + round(round(sigmoid(g)) * shared)"}

COMPILE_SPECS = [
    dict(fn=_route_kernel, signature={"logits_ptr": "*bf16", "w_ptr": "*fp32", "ids_ptr": "*i64", "E": "i32",
                                      "stride_t": "i32"},
         constexprs={"K": 8, "BLOCK_E": 128, "BLOCK_K": 8, "NORM": True}, num_warps=1),
    dict(fn=_combine_kernel, signature={"y_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*bf16", "H": "i32"},
         constexprs={"K": 8, "BLOCK_H": BLOCK_H}, num_warps=4, enable_fp_fusion=False),   # as launched
    dict(fn=_shared_add_kernel, signature={"r_ptr": "*bf16", "s_ptr": "*bf16", "g_ptr": "*bf16", "out_ptr": "*bf16",
                                           "H": "i32"},
         constexprs={"BLOCK_H": BLOCK_H}, num_warps=4),
] + grouped_compile_specs() + routing_compile_specs()
