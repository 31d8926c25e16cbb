"""What a model config must state for the tik kernels to run it, checked before anything is built
or touched: its family (``layers/family.py``), full attention, a SiLU MLP, a head dim the attention
kernels have, whole GQA groups, and a RoPE the kernels build exactly.

``patch_model`` (the trainer and our engine) and the vLLM plugin's model both call
:func:`validate_config`, so every host refuses the same configs with the same one-line
:class:`~areal_tik.layers.family.UnsupportedModelError`.
"""
from __future__ import annotations

import math

from areal_tik.kernels.moe.checks import MAX_EXPERTS
from areal_tik.kernels.rope import MAX_ANGLE
from areal_tik.layers.family import Family, UnsupportedModelError, family_of, head_dim_of

__all__ = ["validate_config", "rope_spec", "SUPPORTED_HEAD_DIMS"]

SUPPORTED_HEAD_DIMS = (64, 128)
_ROPE_FIELDS = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def rope_spec(cfg) -> tuple[float, dict | None]:
    """(theta, scaling) of the model's RoPE; ``UnsupportedModelError`` for a RoPE type its family does not
    list (the ones ``ops.rope_table`` builds: default, linear, llama3; yarn, dynamic, longrope, ... are refused
    for both kernel modes, so the A/B runs one model), for missing or non-positive scaling fields, and for
    positions past the table's exact range."""
    family = family_of(cfg)
    rp = getattr(cfg, "rope_parameters", None) or {}
    if "full_attention" in rp and isinstance(rp["full_attention"], dict):
        rp = rp["full_attention"]
    theta = rp.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError("config has no rope_theta")
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
        raise UnsupportedModelError(f"rope_theta must be a finite number above 1, got {theta!r}")
    rtype = rp.get("rope_type", rp.get("type", "default"))
    scaling = None if rtype in (None, "default") else dict(rp)
    legacy = getattr(cfg, "rope_scaling", None)
    if scaling is None and isinstance(legacy, dict) and legacy.get("rope_type", legacy.get("type")) not in (None, "default"):
        scaling = dict(legacy)
    max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    if scaling is not None:
        _check_rope_scaling(scaling, family)
    # the table's largest angle is (max_positions - 1) * inv_freq[0], inv_freq[0] = 1 (/ factor for linear)
    linear = scaling is not None and scaling.get("rope_type", scaling.get("type")) == "linear"
    if (max_positions - 1) / (float(scaling["factor"]) if linear else 1.0) >= MAX_ANGLE:
        raise UnsupportedModelError(f"max_position_embeddings {max_positions} is past the RoPE table's exact range")
    return float(theta), scaling


def _check_rope_scaling(scaling: dict, family: Family) -> None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in family.rope_types:
        raise UnsupportedModelError(f"RoPE type {kind!r} is not supported (supported: "
                                    f"{', '.join(family.rope_types)}); use a checkpoint without rope scaling or "
                                    "with linear or llama3 scaling")
    for field in _ROPE_FIELDS.get(kind, ()):
        v = scaling.get(field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise UnsupportedModelError(f"RoPE {kind} scaling needs a positive {field}, got {v!r}")
    if kind == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise UnsupportedModelError(f"RoPE llama3 scaling needs low_freq_factor < high_freq_factor, got "
                                    f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}")


def _check_moe(cfg, mt: str, experts: int) -> None:
    k = getattr(cfg, "num_experts_per_tok", None)
    if not 1 <= experts <= MAX_EXPERTS:
        raise UnsupportedModelError(f"{mt}: {experts} experts; the router supports 1..{MAX_EXPERTS}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= experts:
        raise UnsupportedModelError(f"{mt}: num_experts_per_tok must be in [1, {experts}], got {k!r}")
    if getattr(cfg, "output_router_logits", False):
        raise UnsupportedModelError(f"{mt}: output_router_logits (the router's auxiliary loss) is not supported; "
                                    "set it to false")
    if not isinstance(getattr(cfg, "decoder_sparse_step", 1) or 1, int):
        raise UnsupportedModelError(f"{mt}: decoder_sparse_step must be an int, got {cfg.decoder_sparse_step!r}")


def validate_config(cfg) -> Family:
    """The family of ``cfg``, or :class:`UnsupportedModelError` for a config the tik kernels cannot run: other
    model types, experts in a family without MoE blocks, MoE settings the router cannot run, sliding windows,
    non-SiLU MLPs, head dims the attention kernels lack, uneven GQA, RoPE types the family does not list."""
    family = family_of(cfg)
    mt = family.model_type
    experts = getattr(cfg, "num_local_experts", 0) or getattr(cfg, "num_experts", 0)
    if experts and not family.moe:
        raise UnsupportedModelError(f"{mt}: mixture-of-experts layers are not supported for this family")
    if family.moe and experts:
        _check_moe(cfg, mt, experts)
    layer_types = getattr(cfg, "layer_types", None) or []
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(f"{mt}: sliding-window attention is not supported (layer_types={layer_types})")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{mt}: MLP activation {cfg.hidden_act!r} is not SiLU")
    head_dim = head_dim_of(cfg)
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise UnsupportedModelError(f"{mt}: head_dim {head_dim} not in {SUPPORTED_HEAD_DIMS}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise UnsupportedModelError(f"{mt}: {cfg.num_attention_heads} query heads not a multiple of "
                                    f"{cfg.num_key_value_heads} KV heads")
    rope_spec(cfg)
    return family
