"""The mixture-of-experts block of the decoder graph: what runs in ``mlp``'s place on a family's MoE layers.

Per MoE layer, on ``x [T, H]`` (the post-attention norm's output), with the bound ops::

    logits   = linear(x, gate.weight)                        [T, E]   the batch-invariant GEMM, model dtype
    w, ids   = moe_route(logits, k, norm_topk_prob)          [T, k]   fp32 softmax, top-k (ties: lower index)
    y        = moe_experts(x, experts.gate_up_proj, experts.down_proj, ids)    [T, k, H]
    out      = moe_combine(y, w)                             [T, H]   fp32 in rank order, one rounding
    (shared-expert families)  out = moe_shared_add(out, shared_expert(x), linear(x, shared_expert_gate.weight))

Every step computes a token's row from that token's inputs alone, so the block's output for a token does not
depend on the batch (``kernels/moe``: each op's invariance). Which layers are MoE layers is the family
table's rule (:func:`~areal_tik.layers.family.moe_layer`); the others keep the dense MLP.

- :class:`TikMoE`: the module ``patch_model`` installs by ``__class__`` swap on HF's sparse-MoE block
  (``Qwen3MoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``), keeping its children and parameter names
  (``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``, ``shared_expert.*``,
  ``shared_expert_gate.weight``); :func:`build_moe_block` builds the same tree for a host without an HF model.
- ``kernels="default"``: HF's block runs unchanged (its own router, expert loop and ``index_add_``), fed the
  graph's flattened tokens (:func:`default_moe_forward`).
- Host syncs: the triton ``moe_experts`` forward never waits on the host (grouped GEMMs with static grids), so a
  model whose MoE blocks are bound to it is captured in CUDA graphs like a dense one; the torch_ref experts and
  HF's own block (``kernels="default"``) loop over experts on the host, and a model with such a block runs
  eagerly (:func:`host_synced`).
"""
from __future__ import annotations

import types

import torch
from torch import nn

from areal_tik.kernels.moe import HOST_SYNC_FREE
from areal_tik.layers.family import Family, UnsupportedModelError
from areal_tik.layers.modules import TikLinear, TikMLP

__all__ = ["TikMoE", "MoeRouterWeights", "MoeExpertWeights", "check_moe_block", "patch_moe_block",
           "build_moe_block", "default_moe_forward", "host_synced", "per_expert_views", "WritableTensors",
           "experts_synced"]

_MLP = ("gate_proj", "up_proj", "down_proj")


class TikMoE(nn.Module):
    """An MoE block on the bound ops (the module docstring's arithmetic). Attributes: ``_tik_ops``,
    ``_tik_top_k``, ``_tik_norm_topk`` (the config's ``num_experts_per_tok``, ``norm_topk_prob``)."""

    _tik_moe = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self._tik_ops
        logits = ops.linear(x, self.gate.weight)
        w, ids = ops.moe_route(logits, self._tik_top_k, self._tik_norm_topk)
        y = ops.moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, ids)
        out = ops.moe_combine(y, w)
        if hasattr(self, "shared_expert"):
            out = ops.moe_shared_add(out, self.shared_expert(x), self.shared_expert_gate(x))
        return out


class MoeRouterWeights(nn.Module):
    """``weight [E, H]``: the router's parameter under HF's name (``mlp.gate.weight``)."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class MoeExpertWeights(nn.Module):
    """``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` under HF's names (``mlp.experts.*``)."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))


def per_expert_views(named: dict) -> dict[str, tuple[str, torch.Tensor]]:
    """The per-expert checkpoint names of every fused expert tensor in ``named`` (name -> tensor), each mapped
    to ``(fused name, view)``: ``<p>.experts.<e>.gate_proj.weight`` / ``up_proj.weight`` are the first / second
    half of ``<p>.experts.gate_up_proj[e]``, ``<p>.experts.<e>.down_proj.weight`` is ``<p>.experts.down_proj[e]``.
    transformers 5 keeps an MoE model's experts fused but saves its checkpoints under these names; a weight
    update from such a checkpoint writes through the views."""
    out = {}
    for name, t in named.items():
        for fused in ("gate_up_proj", "down_proj"):
            if not name.endswith(f"experts.{fused}") or t.dim() != 3:
                continue
            prefix = name[: -len(fused)]
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                if fused == "down_proj":
                    out[f"{prefix}{e}.down_proj.weight"] = (name, t[e])
                else:
                    out[f"{prefix}{e}.gate_proj.weight"] = (name, t[e, :half])
                    out[f"{prefix}{e}.up_proj.weight"] = (name, t[e, half:])
    return out


class WritableTensors:
    """A model's tensors by name (``named``) for a weight load or update to write into, and the per-expert views of
    its fused MoE expert weights under their checkpoint names. The views are built at the first name the model's
    own tensors lack: an update whose names are all the model's own (a distributed one sends the fused names)
    never builds the views of every expert."""

    def __init__(self, named: dict):
        self.own, self._views = named, None

    def lookup(self, name: str) -> tuple[str, torch.Tensor] | None:
        """``(owner, tensor to write)`` for a checkpoint name: ``(name, the model's tensor)`` for one of the model's
        own names, ``(fused parameter name, the expert's view)`` for a per-expert MoE name, None otherwise."""
        dst = self.own.get(name)
        if dst is not None:
            return name, dst
        if self._views is None:
            self._views = per_expert_views(self.own)
        return self._views.get(name)


def check_moe_block(mlp: nn.Module, cfg, family: Family, layer_idx: int) -> None:
    """:class:`UnsupportedModelError` unless ``mlp`` has the MoE layout of ``family`` at ``cfg``'s sizes."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    want = {"gate.weight": (getattr(gate, "weight", None), (E, H)),
            "experts.gate_up_proj": (getattr(experts, "gate_up_proj", None), (E, 2 * I, H)),
            "experts.down_proj": (getattr(experts, "down_proj", None), (E, H, I))}
    for name, (p, shape) in want.items():
        if not isinstance(p, torch.Tensor) or tuple(p.shape) != shape:
            got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise UnsupportedModelError(f"layer {layer_idx}: MoE block {type(mlp).__name__} has no mlp.{name} of shape "
                                        f"{shape} (got {got}); expected HF's fused expert layout")
    shared = getattr(mlp, "shared_expert", None)
    if family.shared_expert:
        if shared is None or not all(isinstance(getattr(shared, n, None), nn.Linear) for n in _MLP) \
                or not isinstance(getattr(mlp, "shared_expert_gate", None), nn.Linear):
            raise UnsupportedModelError(f"layer {layer_idx}: {family.model_type} MoE block without "
                                        "shared_expert/shared_expert_gate, unlike its family entry (layers/family.py)")
    elif shared is not None:
        raise UnsupportedModelError(f"layer {layer_idx}: MoE block with a shared expert, unlike the "
                                    f"{family.model_type} family entry (layers/family.py)")


def _configure(mlp: nn.Module, cfg, ops) -> None:
    mlp._tik_ops = ops
    mlp._tik_top_k = int(cfg.num_experts_per_tok)
    mlp._tik_norm_topk = bool(getattr(cfg, "norm_topk_prob", False))


def default_moe_forward(self, x: torch.Tensor) -> torch.Tensor:
    """HF's own block (``kernels="default"``) on the graph's ``[T, H]``: it takes ``[B, S, H]``; some
    transformers versions also return the router logits."""
    out = type(self).forward(self, x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


def patch_moe_block(mlp: nn.Module, cfg, ops) -> None:
    """Put HF's MoE block ``mlp`` (checked by :func:`check_moe_block`) on the tik ops (``ops``) in place, or,
    with ``ops=None`` (the default kernels), leave HF's arithmetic and feed it flattened tokens."""
    if ops is None:
        mlp.forward = types.MethodType(default_moe_forward, mlp)
        mlp._tik_moe = True
        return
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        for n in _MLP:
            getattr(shared, n).__class__ = TikLinear
            getattr(shared, n)._tik_ops = ops
        shared.__class__, shared._tik_ops = TikMLP, ops
        mlp.shared_expert_gate.__class__, mlp.shared_expert_gate._tik_ops = TikLinear, ops
    mlp.__class__ = TikMoE
    _configure(mlp, cfg, ops)


def _linear(n_in: int, n_out: int, ops) -> TikLinear:
    lin = TikLinear(n_in, n_out, bias=False)
    lin._tik_ops = ops
    return lin


def build_moe_block(cfg, family: Family, ops) -> TikMoE:
    """A :class:`TikMoE` of ``cfg``'s sizes with HF's module tree and names (weights uninitialised)."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    block = TikMoE()
    block.gate = MoeRouterWeights(E, H)
    block.experts = MoeExpertWeights(E, H, I)
    if family.shared_expert:
        S = cfg.shared_expert_intermediate_size
        shared = TikMLP()
        shared.gate_proj, shared.up_proj, shared.down_proj = _linear(H, S, ops), _linear(H, S, ops), _linear(S, H, ops)
        shared._tik_ops = ops
        block.shared_expert = shared
        block.shared_expert_gate = _linear(H, 1, ops)
    _configure(block, cfg, ops)
    return block


def experts_synced(ops) -> bool:
    """Whether the experts op bound in ``ops`` waits on the host (read from the bound implementation, so a
    wrapper of the ops, e.g. ``dispatch/opaque.py``'s, answers as the ops it wraps). ``ops`` None: HF's own block
    on the default kernels, which loops over experts on the host."""
    return ops is None or ops.impls["moe_experts"].fn not in HOST_SYNC_FREE


def _block_synced(m: nn.Module) -> bool:
    return experts_synced(getattr(m, "_tik_ops", None))


def host_synced(model: nn.Module) -> bool:
    """Whether a forward of ``model`` waits on the host: an MoE block whose bound experts op loops over experts on
    the host (torch_ref, HF's own block), read from the bound implementation. Such a model runs eagerly, never in
    a CUDA graph; with the triton experts (:data:`~areal_tik.kernels.moe.HOST_SYNC_FREE`) it is captured."""
    return any(getattr(m, "_tik_moe", False) and _block_synced(m) for m in model.modules())
