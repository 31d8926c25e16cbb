"""Bound ops that ``torch.compile`` sees as opaque ``torch.library`` custom ops (namespace ``tik``).

A host that compiles the decoder graph (the vLLM plugin under vLLM's ``VLLM_COMPILE`` mode, whose
piecewise CUDA graphs cover the steps that mix prefill and decode) must not trace into our launchers:
they choose tiles from the concrete row count, check arguments and launch Triton or CUDA kernels on the
host. :func:`opaque` wraps a :class:`~areal_tik.dispatch.bound.BoundOps` so that every op the decoder's
forward calls (:data:`FORWARD_OPS`) is one custom op: the compiler records the call with the output
shapes of its fake implementation and nothing inside; at run time the call runs the bound
implementation with the real tensors. Same bits as calling the bound op (tests), no change of numerics.
Every other attribute (``impls``, ``selection``, the attention pair, which the host calls outside
traced code) is the wrapped object's.

Outputs never alias inputs (a custom op's rule): an op whose implementation returns an input returns
a copy here. Inference only: the custom ops have no autograd (training runs the bound ops directly).
"""
from __future__ import annotations

import functools

import torch

from areal_tik.dispatch.bound import BoundOps

__all__ = ["FORWARD_OPS", "OpaqueOps", "opaque"]

_SLOTS: list[BoundOps] = []   # the BoundOps a custom op call names by its ``slot`` argument (a constant when traced)


def _fresh(out: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """``out``, copied if it shares storage with an input (a custom op may not return an alias)."""
    for t in inputs:
        if t is not None and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            return out.clone()
    return out


@torch.library.custom_op("tik::linear", mutates_args=())
def _linear(slot: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _fresh(_SLOTS[slot].linear(x, weight, bias), x, weight, bias)


@_linear.register_fake
def _(slot, x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("tik::rms_norm", mutates_args=())
def _rms_norm(slot: int, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _fresh(_SLOTS[slot].rms_norm(x, weight, eps), x, weight)


@_rms_norm.register_fake
def _(slot, x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("tik::add_rms_norm", mutates_args=())
def _add_rms_norm(slot: int, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, res = _SLOTS[slot].add_rms_norm(x, residual, weight, eps)
    return _fresh(out, x, residual, weight), _fresh(res, x, residual, weight)


@_add_rms_norm.register_fake
def _(slot, x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("tik::apply_rope", mutates_args=())
def _apply_rope(slot: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    return _fresh(_SLOTS[slot].apply_rope(x, cos, sin, positions), x)


@_apply_rope.register_fake
def _(slot, x, cos, sin, positions):
    return torch.empty_like(x)


@torch.library.custom_op("tik::qk_norm_rope", mutates_args=())
def _qk_norm_rope(slot: int, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                  eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    qo, ko = _SLOTS[slot].qk_norm_rope(q, k, cos, sin, positions, q_weight, k_weight, eps)
    return _fresh(qo, q, k), _fresh(ko, q, k)


@_qk_norm_rope.register_fake
def _(slot, q, k, cos, sin, positions, q_weight=None, k_weight=None, eps=1e-6):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("tik::silu_mul", mutates_args=())
def _silu_mul(slot: int, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _fresh(_SLOTS[slot].silu_mul(gate, up), gate, up)


@_silu_mul.register_fake
def _(slot, gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("tik::silu_mul_packed", mutates_args=())
def _silu_mul_packed(slot: int, gu: torch.Tensor) -> torch.Tensor:
    return _fresh(_SLOTS[slot].silu_mul_packed(gu), gu)


@_silu_mul_packed.register_fake
def _(slot, gu):
    return gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))


@torch.library.custom_op("tik::linear_silu_mul", mutates_args=())
def _linear_silu_mul(slot: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _SLOTS[slot].linear_silu_mul(x, weight, bias)


@_linear_silu_mul.register_fake
def _(slot, x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


@torch.library.custom_op("tik::moe_route", mutates_args=())
def _moe_route(slot: int, logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _SLOTS[slot].moe_route(logits, top_k, norm_topk_prob)


@_moe_route.register_fake
def _(slot, logits, top_k, norm_topk_prob):
    T = logits.shape[0]
    return logits.new_empty((T, top_k), dtype=torch.float32), logits.new_empty((T, top_k), dtype=torch.int64)


@torch.library.custom_op("tik::moe_experts", mutates_args=())
def _moe_experts(slot: int, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
    return _SLOTS[slot].moe_experts(x, w_gate_up, w_down, topk_ids)


@_moe_experts.register_fake
def _(slot, x, w_gate_up, w_down, topk_ids):
    return x.new_empty((x.shape[0], topk_ids.shape[1], x.shape[-1]))


@torch.library.custom_op("tik::moe_combine", mutates_args=())
def _moe_combine(slot: int, expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return _SLOTS[slot].moe_combine(expert_out, weights)


@_moe_combine.register_fake
def _(slot, expert_out, weights):
    return expert_out.new_empty((expert_out.shape[0], expert_out.shape[-1]))


@torch.library.custom_op("tik::moe_shared_add", mutates_args=())
def _moe_shared_add(slot: int, routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    return _fresh(_SLOTS[slot].moe_shared_add(routed, shared, gate_logit), routed, shared, gate_logit)


@_moe_shared_add.register_fake
def _(slot, routed, shared, gate_logit):
    return torch.empty_like(routed)


# every op of the decoder's forward (``layers/decoder.py``, ``layers/modules.py``, ``layers/moe.py``,
# ``layers/steps.py``) and its custom op
_CUSTOM = {"linear": _linear, "rms_norm": _rms_norm, "add_rms_norm": _add_rms_norm, "apply_rope": _apply_rope,
           "qk_norm_rope": _qk_norm_rope,
           "silu_mul": _silu_mul, "silu_mul_packed": _silu_mul_packed, "linear_silu_mul": _linear_silu_mul,
           "moe_route": _moe_route,
           "moe_experts": _moe_experts, "moe_combine": _moe_combine, "moe_shared_add": _moe_shared_add}
FORWARD_OPS = tuple(_CUSTOM)


class OpaqueOps:
    """``ops`` with :data:`FORWARD_OPS` as ``tik::`` custom ops (same implementations, same bits); every other
    attribute is ``ops``'."""

    def __init__(self, ops: BoundOps):
        self.inner = ops
        slot = len(_SLOTS)
        _SLOTS.append(ops)
        for name in FORWARD_OPS:
            if name in ops.impls:
                setattr(self, name, functools.partial(_CUSTOM[name], slot))

    def __getattr__(self, name: str):   # only reached for names not set above
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"OpaqueOps({self.inner!r})"


def opaque(ops: BoundOps) -> OpaqueOps:
    """``ops`` as :class:`OpaqueOps`: one per ``BoundOps`` (every module of a model shares it, and one slot serves
    it); an ``OpaqueOps`` is returned as it is."""
    if isinstance(ops, OpaqueOps):
        return ops
    made = getattr(ops, "_opaque", None)
    if made is None:
        made = ops._opaque = OpaqueOps(ops)
    return made
