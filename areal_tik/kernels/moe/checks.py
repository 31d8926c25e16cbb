"""Argument checks of the mixture-of-experts ops (router, experts, combine, shared-expert add): one-line
``TypeError`` / ``ValueError`` naming the argument, raised before any kernel runs."""
from __future__ import annotations

import torch

from areal_tik.kernels._dense_common import (
    check_contiguous, check_dtype, check_same_device, check_same_dtype, check_triton_device,
)

__all__ = ["validate_route", "validate_experts", "validate_combine", "validate_shared_add", "MAX_EXPERTS"]

MAX_EXPERTS = 1024     # the router keeps one token's logits in one program's block
_IDS = (torch.int32, torch.int64)


def _devices(triton_path: bool, *named) -> None:
    (check_triton_device if triton_path else check_same_device)(*named)


def validate_route(logits: torch.Tensor, top_k: int, triton_path: bool) -> None:
    check_dtype("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"moe_route: logits must be [T, E], got shape {tuple(logits.shape)}")
    E = logits.shape[1]
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"moe_route: {E} experts; supported 1..{MAX_EXPERTS}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"moe_route: top_k must be an int in [1, {E}], got {top_k!r}")
    check_contiguous("logits", logits)
    _devices(triton_path, ("logits", logits))


def validate_experts(x, w_gate_up, w_down, topk_ids, triton_path: bool) -> None:
    for n, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        check_dtype(n, t)
    check_same_dtype(x=x, w_gate_up=w_gate_up, w_down=w_down)
    check_dtype("topk_ids", topk_ids, _IDS)
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3 or topk_ids.dim() != 2:
        raise ValueError(f"moe_experts: x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], topk_ids [T, k] expected, "
                         f"got {tuple(x.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}, "
                         f"{tuple(topk_ids.shape)}")
    T, H = x.shape
    E, I2, H2 = w_gate_up.shape
    if H2 != H or I2 % 2 or tuple(w_down.shape) != (E, H, I2 // 2):
        raise ValueError(f"moe_experts: w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} do not "
                         f"fit hidden size {H} ([E, 2I, H] and [E, H, I])")
    if topk_ids.shape[0] != T:
        raise ValueError(f"moe_experts: topk_ids has {topk_ids.shape[0]} rows for {T} tokens")
    for n, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down), ("topk_ids", topk_ids)):
        check_contiguous(n, t)
    if topk_ids.device.type == "cpu" and topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= E):
        raise ValueError(f"moe_experts: topk_ids must lie in [0, {E})")
    _devices(triton_path, ("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down), ("topk_ids", topk_ids))


def validate_combine(expert_out, weights, triton_path: bool) -> None:
    check_dtype("expert_out", expert_out)
    check_dtype("weights", weights, (torch.float32,))
    if expert_out.dim() != 3 or tuple(weights.shape) != tuple(expert_out.shape[:2]):
        raise ValueError(f"moe_combine: expert_out [T, k, H] and fp32 weights [T, k] expected, got "
                         f"{tuple(expert_out.shape)} and {tuple(weights.shape)}")
    check_contiguous("expert_out", expert_out)
    check_contiguous("weights", weights)
    _devices(triton_path, ("expert_out", expert_out), ("weights", weights))


def validate_shared_add(routed, shared, gate_logit, triton_path: bool) -> None:
    for n, t in (("routed", routed), ("shared", shared), ("gate_logit", gate_logit)):
        check_dtype(n, t)
        check_contiguous(n, t)
    check_same_dtype(routed=routed, shared=shared, gate_logit=gate_logit)
    if routed.dim() != 2 or routed.shape != shared.shape or tuple(gate_logit.shape) != (routed.shape[0], 1):
        raise ValueError(f"moe_shared_add: routed [T, H], shared [T, H], gate_logit [T, 1] expected, got "
                         f"{tuple(routed.shape)}, {tuple(shared.shape)}, {tuple(gate_logit.shape)}")
    _devices(triton_path, ("routed", routed), ("shared", shared), ("gate_logit", gate_logit))
