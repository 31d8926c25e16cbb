"""``patch_model``: put an HF Qwen2/Qwen2.5, Qwen3 or Llama-3 causal LM on tik kernels, in place.

What changes (``kernels="tik"``):
- every ``nn.Linear`` under the decoder and ``lm_head`` (or a critic's value head ``score``)
  -> ``TikLinear`` (``ops.linear``);
- every RMSNorm -> ``TikRMSNorm`` (``ops.rms_norm``), Qwen3's q/k norms included;
- MLPs -> ``TikMLP`` (``ops.silu_mul``);
- attention -> ``PagedAttention``: RoPE from one fp32 table built by ``ops.rope_table``
  (applied by ``ops.apply_rope``), ``ops.attention_varlen`` for training,
  ``ops.kv_cache_write`` + ``ops.attention_paged`` when an engine context is set;
- decoder layers and the base model get the forwards of ``modules.py`` (one graph for
  rollout and training).
``kernels="default"`` keeps HF's math (``nn.Linear``/cuBLAS, HF RMSNorm, MLP and RoPE,
SDPA) and only makes attention packed-varlen and paged-cache aware, so the same engine
runs the baseline.

What never changes: parameter names, module tree, parameter tying, dtypes, the classes of
decoder layers (FSDP2 wraps by ``_no_split_modules`` class name). Swaps are ``__class__``
assignments to subclasses / siblings with the same attributes.

Refused with ``UnsupportedModelError`` before anything is touched: unknown ``model_type``
(MoE variants included), sliding-window layers, non-SiLU MLPs, head dims the attention
kernels lack, unexpected module layouts, RoPE types other than default, linear and llama3
(yarn, dynamic, longrope, ...). A model is never left half patched.
"""
from __future__ import annotations

import math
import types

from torch import nn

from areal_tik.dispatch.bound import BoundOps, bind
from areal_tik.layers import modules as M

__all__ = ["patch_model", "UnsupportedModelError", "SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE_TYPES", "kernels_of",
           "ops_of", "validate_config", "rope_spec"]

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_FIELDS = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
_SUPPORTED_HEAD_DIMS = (64, 128)


class UnsupportedModelError(ValueError):
    pass


def kernels_of(model: nn.Module) -> str | None:
    """``"tik"``/``"default"`` for a patched model, None for an unpatched one."""
    return getattr(model, "_tik_kernels", None)


def ops_of(model: nn.Module) -> BoundOps | None:
    """The ops bound to a model patched with ``kernels="tik"`` (None otherwise): its log-prob head
    and the engine's sampler call these, so the whole model runs one selection."""
    return getattr(model, "_tik_ops", None)


def rope_spec(cfg) -> tuple[float, dict | None]:
    """(theta, scaling) of the model's RoPE; ``UnsupportedModelError`` for any RoPE type but
    ``default``, ``linear`` and ``llama3`` (the ones ``ops.rope_table`` builds; yarn,
    dynamic, longrope, ... are refused for both kernel modes, so the A/B runs one model), for
    missing or non-positive scaling fields, and for positions past the table's exact range."""
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
        _check_rope_scaling(scaling)
    # the table's largest angle is (max_positions - 1) * inv_freq[0], inv_freq[0] = 1 (/ factor for linear)
    from areal_tik.kernels.rope import _MAX_ANGLE
    linear = scaling is not None and scaling.get("rope_type", scaling.get("type")) == "linear"
    if (max_positions - 1) / (float(scaling["factor"]) if linear else 1.0) >= _MAX_ANGLE:
        raise UnsupportedModelError(f"max_position_embeddings {max_positions} is past the RoPE table's exact range")
    return float(theta), scaling


def _check_rope_scaling(scaling: dict) -> None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"RoPE type {kind!r} is not supported (supported: "
                                    f"{', '.join(SUPPORTED_ROPE_TYPES)}); use a checkpoint without rope scaling or "
                                    "with linear or llama3 scaling")
    for field in _ROPE_FIELDS.get(kind, ()):
        v = scaling.get(field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise UnsupportedModelError(f"RoPE {kind} scaling needs a positive {field}, got {v!r}")
    if kind == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise UnsupportedModelError(f"RoPE llama3 scaling needs low_freq_factor < high_freq_factor, got "
                                    f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}")


def validate_config(cfg) -> None:
    """Refuse, with :class:`UnsupportedModelError`, a config the tik kernels cannot run: other model
    types (MoE included), sliding windows, non-SiLU or biased MLPs, head dims the attention kernels
    lack, uneven GQA, RoPE types other than default, linear and llama3."""
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        hint = " (mixture-of-experts models are not supported)" if mt and "moe" in mt else ""
        raise UnsupportedModelError(f"patch_model supports model_type {SUPPORTED_MODEL_TYPES}, got {mt!r}{hint}")
    if getattr(cfg, "num_local_experts", 0) or getattr(cfg, "num_experts", 0):
        raise UnsupportedModelError(f"{mt}: mixture-of-experts layers are not supported")
    layer_types = getattr(cfg, "layer_types", None) or []
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(f"{mt}: sliding-window attention is not supported (layer_types={layer_types})")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{mt}: MLP activation {cfg.hidden_act!r} is not SiLU")
    if getattr(cfg, "mlp_bias", False):
        raise UnsupportedModelError(f"{mt}: MLP biases are not supported")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim not in _SUPPORTED_HEAD_DIMS:
        raise UnsupportedModelError(f"{mt}: head_dim {head_dim} not in {_SUPPORTED_HEAD_DIMS}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise UnsupportedModelError(f"{mt}: {cfg.num_attention_heads} query heads not a multiple of "
                                    f"{cfg.num_key_value_heads} KV heads")
    rope_spec(cfg)


def _validate(model: nn.Module) -> tuple[nn.Module, object]:
    cfg = getattr(model, "config", None)
    validate_config(cfg)
    mt = cfg.model_type
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None or not hasattr(base, "layers") or _head_name(model) is None:
        raise UnsupportedModelError(f"{type(model).__name__}: expected a *ForCausalLM with .model.layers and .lm_head "
                                    "(or a *ForTokenClassification value model with .model.layers and .score)")
    for i, layer in enumerate(base.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for owner, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj"))):
            if owner is None or not all(isinstance(getattr(owner, n, None), nn.Linear) for n in names):
                raise UnsupportedModelError(f"layer {i}: unexpected attention/MLP layout ({type(owner).__name__})")
        if getattr(attn, "sliding_window", None):
            raise UnsupportedModelError(f"layer {i}: sliding window {attn.sliding_window}")
        for n in ("input_layernorm", "post_attention_layernorm"):
            if not hasattr(getattr(layer, n, None), "variance_epsilon"):
                raise UnsupportedModelError(f"layer {i}: {n} is not an RMSNorm with variance_epsilon")
        if mt == "qwen3" and not (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")):
            raise UnsupportedModelError(f"layer {i}: qwen3 attention without q_norm/k_norm")
    if not hasattr(base.norm, "variance_epsilon"):
        raise UnsupportedModelError("final norm is not an RMSNorm")
    return base, cfg


def _head_name(model: nn.Module) -> str | None:
    """``lm_head`` (causal LM) or ``score`` (HF ``*ForTokenClassification``: AReaL's critic,
    ``is_critic=True``, a linear value head with bias on the final-norm hidden states)."""
    for n in ("lm_head", "score"):
        if isinstance(getattr(model, n, None), nn.Linear):
            return n
    return None


def _swap(module: nn.Module, cls: type, ops: BoundOps | None = None) -> None:
    module.__class__ = cls
    if ops is not None:
        module._tik_ops = ops


def patch_model(model: nn.Module, kernels: str = "tik", backend: str | None = None) -> nn.Module:
    """Patch ``model`` (an HF Qwen2/Qwen3/Llama ``*ForCausalLM``, or the same decoder under a
    ``*ForTokenClassification`` value head as AReaL's critic builds it) in place and return it.

    ``kernels="tik"``: every op on the tik kernels (bitwise rollout == training).
    ``kernels="default"``: HF's own math, but attention understands packed sequences and
    the engine's paged cache (the baseline). Patching twice with the same kernels is a
    no-op; with different kernels it raises (build a fresh model).

    ``backend`` (``Settings.backend``: None, ``"triton"``, ``"attention_paged=triton"``, ...)
    selects each op's implementation now, once, for every layer of this model; an unavailable
    request raises ``BackendUnavailable`` before anything is touched.
    """
    if kernels not in ("tik", "default"):
        raise ValueError(f"kernels must be 'tik' or 'default', got {kernels!r}")
    prev = kernels_of(model)
    if prev is not None:
        if prev != kernels:
            raise ValueError(f"model already patched with kernels={prev!r}; build a fresh model for {kernels!r}")
        return model
    base, cfg = _validate(model)
    ops = bind(backend) if kernels == "tik" else None
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if ops is not None:
        ops.check_shapes(head_dim)     # a shape an implementation refuses fails before anything is touched
    hf_module = type(base.layers[0].self_attn).__module__
    tik = kernels == "tik"

    for i, layer in enumerate(base.layers):
        attn = layer.self_attn
        if tik:
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                _swap(getattr(attn, n), M.TikLinear, ops)
            for n in ("q_norm", "k_norm"):
                if hasattr(attn, n):
                    _swap(getattr(attn, n), M.TikRMSNorm, ops)
            for n in ("gate_proj", "up_proj", "down_proj"):
                _swap(getattr(layer.mlp, n), M.TikLinear, ops)
            _swap(layer.mlp, M.TikMLP, ops)
            _swap(layer.input_layernorm, M.TikRMSNorm, ops)
            _swap(layer.post_attention_layernorm, M.TikRMSNorm, ops)
            _swap(attn, M.TikAttention, ops)
        else:
            _swap(attn, M.DefaultAttention)
        attn._tik_heads = cfg.num_attention_heads
        attn._tik_kv_heads = cfg.num_key_value_heads
        attn._tik_hf_module = hf_module
        attn.head_dim = head_dim
        attn.scaling = head_dim ** -0.5
        attn.layer_idx = i
        layer.forward = types.MethodType(M.decoder_layer_forward, layer)
    if tik:
        _swap(base.norm, M.TikRMSNorm, ops)
        _swap(getattr(model, _head_name(model)), M.TikLinear, ops)
        theta, scaling = rope_spec(cfg)
        base._tik_rope = M.RopeCache(head_dim, cfg.max_position_embeddings, theta, scaling, ops.rope_table)
        base._tik_rope_inputs = types.MethodType(M.tik_rope_inputs, base)
        model._tik_ops = ops
    else:
        base._tik_rope_inputs = types.MethodType(M.default_rope_inputs, base)
    base._tik_kernels = kernels
    base.forward = types.MethodType(M.base_model_forward, base)
    model._tik_kernels = kernels
    return model
