"""``patch_model``: put an HF causal LM of a family in ``layers/family.py`` (Qwen2/Qwen2.5, Qwen3, Llama-3,
Qwen3-MoE, Qwen2-MoE) on tik kernels, in place.

What changes (``kernels="tik"``):
- every ``nn.Linear`` under the decoder and ``lm_head`` (or a critic's value head ``score``)
  -> ``TikLinear`` (``ops.linear``);
- every RMSNorm -> ``TikRMSNorm`` (``ops.rms_norm``), Qwen3's q/k norms included;
- MLPs -> ``TikMLP`` (``ops.silu_mul``); on a family's MoE layers the sparse-MoE block -> ``TikMoE``
  (``layers/moe.py``: router, experts and combine on the ``moe_*`` ops; a shared expert's MLP -> ``TikMLP``);
- attention -> ``DecoderAttention``, and decoder layers and the base model get the forwards of
  the one decoder graph (``decoder.py``, ``hf_forward.py``); its step (``steps.TikStep``) applies
  RoPE from one fp32 table built by ``ops.rope_table`` (``ops.apply_rope``) and attends by
  ``ops.attention_varlen`` for training, ``ops.kv_cache_write`` + ``ops.attention_paged`` when an
  engine context is set.
``kernels="default"`` keeps HF's math (``nn.Linear``/cuBLAS, HF RMSNorm, MLP and RoPE,
SDPA) in the same graph (``steps.DefaultStep``), only made packed-varlen and paged-cache
aware, so the same engine runs the baseline.

What never changes: parameter names, module tree, parameter tying, dtypes, the classes of
decoder layers (FSDP2 wraps by ``_no_split_modules`` class name). Swaps are ``__class__``
assignments to subclasses / siblings with the same attributes.

Refused with ``UnsupportedModelError`` before anything is touched: a config
``model_config.validate_config`` refuses (a ``model_type`` without a family entry, MoE settings the
router cannot run, sliding windows, non-SiLU MLPs, head dims the attention kernels lack, RoPE types its family does
not list), and a module layout that is not the family entry's (``layers/family.py``: which
projections have biases, q/k norms, which layers hold MoE blocks and their expert layout). A model is never
left half patched.
"""
from __future__ import annotations

import types

from torch import nn

from areal_tik.dispatch.bound import BoundOps, bind
from areal_tik.layers import modules as M
from areal_tik.layers.decoder import DecoderAttention, configure_attention, decoder_layer_forward
from areal_tik.layers.family import UnsupportedModelError, head_dim_of, moe_layer
from areal_tik.layers.hf_forward import base_model_forward, default_step, tik_step
from areal_tik.layers.model_config import validate_config
from areal_tik.layers.moe import check_moe_block, patch_moe_block

__all__ = ["patch_model", "UnsupportedModelError", "kernels_of", "ops_of"]

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def kernels_of(model: nn.Module) -> str | None:
    """``"tik"``/``"default"`` for a patched model, None for an unpatched one."""
    return getattr(model, "_tik_kernels", None)


def ops_of(model: nn.Module) -> BoundOps | None:
    """The ops bound to a model patched with ``kernels="tik"`` (None otherwise): its log-prob head
    and the engine's sampler call these, so the whole model runs one selection."""
    return getattr(model, "_tik_ops", None)


def _validate(model: nn.Module) -> tuple[nn.Module, object]:
    cfg = getattr(model, "config", None)
    family = validate_config(cfg)
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None or not hasattr(base, "layers") or _head_name(model) is None:
        raise UnsupportedModelError(f"{type(model).__name__}: expected a *ForCausalLM with .model.layers and .lm_head "
                                    "(or a *ForTokenClassification value model with .model.layers and .score)")
    biases = {n: family.bias(cfg, part) for part, names in (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)),
                                                             ("mlp", _MLP)) for n in names}
    for i, layer in enumerate(base.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if moe_layer(cfg, i):
            check_moe_block(mlp, cfg, family, i)
        for owner, names in ((attn, _ATTN),) + (() if moe_layer(cfg, i) else ((mlp, _MLP),)):
            if owner is None or not all(isinstance(getattr(owner, n, None), nn.Linear) for n in names):
                raise UnsupportedModelError(f"layer {i}: unexpected attention/MLP layout ({type(owner).__name__})")
            for n in names:
                if (getattr(owner, n).bias is not None) != biases[n]:
                    raise UnsupportedModelError(f"layer {i}: {n} {'has no' if biases[n] else 'has a'} bias, unlike "
                                                f"the {family.model_type} family entry (layers/family.py)")
        if getattr(attn, "sliding_window", None):
            raise UnsupportedModelError(f"layer {i}: sliding window {attn.sliding_window}")
        for n in ("input_layernorm", "post_attention_layernorm"):
            if not hasattr(getattr(layer, n, None), "variance_epsilon"):
                raise UnsupportedModelError(f"layer {i}: {n} is not an RMSNorm with variance_epsilon")
        if family.qk_norm != (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")):
            raise UnsupportedModelError(f"layer {i}: {family.model_type} attention "
                                        f"{'without' if family.qk_norm else 'with'} q_norm/k_norm, unlike its "
                                        "family entry (layers/family.py)")
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
    """Patch ``model`` (an HF ``*ForCausalLM`` of a registered family, or the same decoder under a
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
    if ops is not None:
        ops.check_shapes(head_dim_of(cfg))     # a shape an implementation refuses fails before anything is touched
    tik = kernels == "tik"
    hf_module = type(base.layers[0].self_attn).__module__      # where HF's apply_rotary_pos_emb lives

    for i, layer in enumerate(base.layers):
        attn = layer.self_attn
        if tik:
            for n in _ATTN:
                _swap(getattr(attn, n), M.TikLinear, ops)
            for n in ("q_norm", "k_norm"):
                if hasattr(attn, n):
                    _swap(getattr(attn, n), M.TikRMSNorm, ops)
            if not moe_layer(cfg, i):
                for n in _MLP:
                    _swap(getattr(layer.mlp, n), M.TikLinear, ops)
                _swap(layer.mlp, M.TikMLP, ops)
            _swap(layer.input_layernorm, M.TikRMSNorm, ops)
            _swap(layer.post_attention_layernorm, M.TikRMSNorm, ops)
        if moe_layer(cfg, i):
            patch_moe_block(layer.mlp, cfg, ops)
        _swap(attn, DecoderAttention, ops)
        configure_attention(attn, cfg, i)
        layer.forward = types.MethodType(decoder_layer_forward, layer)
    if tik:
        _swap(base.norm, M.TikRMSNorm, ops)
        _swap(getattr(model, _head_name(model)), M.TikLinear, ops)
        base._tik_rope = M.RopeCache.of_config(cfg, ops.rope_table)
        base._tik_ops = model._tik_ops = ops
    else:
        base._tik_hf_module = hf_module
    base._tik_step = types.MethodType(tik_step if tik else default_step, base)
    base._tik_kernels = kernels
    base.forward = types.MethodType(base_model_forward, base)
    model._tik_kernels = kernels
    return model
