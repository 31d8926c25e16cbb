"""The decoder graph, written once, on flattened tokens ``[T, hidden]``.

Every host runs this arithmetic: the trainer's HF model patched in place (``patch.py``), our
engine (the same patched model, ``layers/hf_forward.py`` is its calling convention) and the
vLLM plugin (``vllm_plugin/causal_lm.py``). Per forward, in this order, with these rounding
points (the model dtype, bf16, between ops; every op is a module of the model):

    h = embed_tokens(ids)                                     [T, H]
    per layer:
        x = input_layernorm(h)
        q, k, v = q_proj(x), k_proj(x), v_proj(x)            (one stacked GEMM when stacked: same bits)
        q, k = step.rope(q, k, q_norm, k_norm)                the per-head norms (families with ``qk_norm``)
                                                              then RoPE (a tik step: one launch, the same
                                                              arithmetic as the two apart)
        a = step.attend(self_attn, q, k, v)                   [T, Hq, D]
        h = h + o_proj(a)
        h = h + mlp(post_attention_layernorm(h))              (down(silu_mul(gate(x), up(x))), or on a
                                                              family's MoE layers the MoE block: moe.py)
    h = norm(h)

Each residual add and the RMSNorm after it (``post_attention_layernorm``, the next layer's
``input_layernorm``, the final ``norm``) run as one ``add_rms_norm`` launch on the tik norms
(:meth:`~areal_tik.layers.modules.TikRMSNorm.fused_add`: the bits of the add then the norm), so a
layer returns its MLP output and the residual stream unsummed and the next norm adds them.

then the host's head: ``lm_head`` logits or the fused log-prob head (``logprob_head.py``).
Which projections carry a bias and whether q/k are normed are family facts
(``layers/family.py``); the modules carry them, the graph has no branch per family.

A host injects only a *step*: the object of one forward that applies RoPE (``step.rope``) and
runs attention (``step.attend``: store this step's K/V where the host keeps its cache, attend,
``[T, Hq, D]``). The patched HF model's steps are in ``layers/steps.py`` (tik kernels: the fp32
RoPE table, packed varlen attention for training, the paged cache for the engine; default
kernels: HF's RoPE and SDPA); the vLLM plugin's step runs vLLM's ``Attention`` layer.

Modules: an HF model keeps its own decoder-layer classes (FSDP2 wraps by class name) and gets
:func:`decoder_layer_forward` bound on each instance, its attention modules become
:class:`DecoderAttention`; a host without an HF model builds :class:`DecoderModel` from the family
table (:func:`build_decoder`, HF parameter names, so HF checkpoints load by name).
"""
from __future__ import annotations

import torch
from torch import nn

from areal_tik.layers.family import family_of, head_dim_of, moe_layer
from areal_tik.layers.model_config import validate_config
from areal_tik.layers.modules import RopeCache, TikLinear, TikMLP, TikRMSNorm
from areal_tik.layers.moe import build_moe_block
from areal_tik.layers.stacking import QKV_ATTR, stacked_projection

__all__ = ["DecoderAttention", "DecoderLayer", "DecoderModel", "decoder_layer_forward", "decoder_forward", "embed",
           "configure_attention", "build_decoder", "add_norm"]


class DecoderAttention(nn.Module):
    """Causal GQA self-attention of the graph: projections, q/k norm, then the step's RoPE and attention.

    Attributes (:func:`configure_attention`): ``_tik_heads``, ``_tik_kv_heads``, ``head_dim``, ``scaling``,
    ``layer_idx``; children as HF names them (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, and ``q_norm``,
    ``k_norm`` for families with ``qk_norm``); ``_tik_ops`` when the model runs the tik kernels."""

    def forward(self, hidden_states: torch.Tensor, step) -> torch.Tensor:
        T = hidden_states.shape[0]
        hq, hkv, D = self._tik_heads, self._tik_kv_heads, self.head_dim
        qkv = stacked_projection(self, QKV_ATTR, hidden_states)     # stacking.py: same bits, one GEMM
        if qkv is None:
            qkv = [self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)]
        q, k, v = qkv[0].reshape(T, hq, D), qkv[1].reshape(T, hkv, D), qkv[2].reshape(T, hkv, D)
        q, k = step.rope(q, k, getattr(self, "q_norm", None), getattr(self, "k_norm", None))
        out = step.attend(self, q, k, v)
        return self.o_proj(out.reshape(T, hq * D))


def configure_attention(attn: nn.Module, cfg, layer_idx: int) -> None:
    """Give an attention module the head layout of ``cfg`` that :class:`DecoderAttention` reads."""
    D = head_dim_of(cfg)
    attn._tik_heads, attn._tik_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    attn.head_dim, attn.scaling, attn.layer_idx = D, D ** -0.5, layer_idx


def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + x), residual + x)``: one fused launch on a tik norm that can, else the add then ``norm``."""
    fused = norm.fused_add(x, residual) if isinstance(norm, TikRMSNorm) else None
    if fused is not None:
        return fused
    s = residual + x
    return norm(s), s


def decoder_layer_forward(self, hidden_states: torch.Tensor, step, residual: torch.Tensor | None = None,
                          *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer on ``[T, H]`` (bound on HF decoder-layer instances; :class:`DecoderLayer`'s forward).
    ``residual`` None: ``hidden_states`` is the layer's input; else the previous layer's MLP output, added to the
    residual stream ``residual`` by this layer's input norm. Returns ``(mlp output, residual stream)``, unsummed."""
    if residual is None:
        residual = hidden_states
        h = self.input_layernorm(hidden_states)
    else:
        h, residual = add_norm(self.input_layernorm, hidden_states, residual)
    h = self.self_attn(h, step)
    h, residual = add_norm(self.post_attention_layernorm, h, residual)
    return self.mlp(h), residual


def embed(base: nn.Module, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """The embeddings of the tokens (or the given ``inputs_embeds``), flattened to ``[T, H]``."""
    h = base.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    return h.reshape(-1, h.shape[-1])


def decoder_forward(base: nn.Module, h: torch.Tensor, step) -> torch.Tensor:
    """The layers and the final norm of ``base`` (an HF base model or a :class:`DecoderModel`) over the
    embeddings ``h`` ``[T, H]``; each layer is called as a module (FSDP's hooks run)."""
    residual = None
    for layer in base.layers[: base.config.num_hidden_layers]:
        h, residual = layer(h, step, residual)
    return base.norm(h) if residual is None else add_norm(base.norm, h, residual)[0]


class DecoderLayer(nn.Module):
    forward = decoder_layer_forward


class DecoderModel(nn.Module):
    """``embed_tokens``, ``layers``, ``norm`` and the RoPE table: an HF base model's tree and names."""


def _linear(n_in: int, n_out: int, bias: bool, ops) -> TikLinear:
    lin = TikLinear(n_in, n_out, bias=bias)
    lin._tik_ops = ops
    return lin


def _rms_norm(dim: int, eps: float, ops) -> TikRMSNorm:
    norm = TikRMSNorm()
    norm.weight = nn.Parameter(torch.ones(dim))
    norm.variance_epsilon, norm._tik_ops = eps, ops
    return norm


def build_decoder(cfg, ops) -> DecoderModel:
    """The tik decoder of ``cfg``'s family for a host that has no HF model (the vLLM plugin): the module
    tree and parameter names of the family's HF base model, every module on the bound ``ops``. Refuses what
    ``patch_model`` refuses (:func:`~areal_tik.layers.model_config.validate_config`)."""
    validate_config(cfg)
    fam = family_of(cfg)
    H, D, eps = cfg.hidden_size, head_dim_of(cfg), cfg.rms_norm_eps
    hq, hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    qkv_b, o_b, mlp_b = fam.bias(cfg, "qkv"), fam.bias(cfg, "o"), fam.bias(cfg, "mlp")
    model = DecoderModel()
    model.config = cfg
    model.embed_tokens = nn.Embedding(cfg.vocab_size, H)
    model.layers = nn.ModuleList()
    for i in range(cfg.num_hidden_layers):
        attn = DecoderAttention()
        attn.q_proj, attn.k_proj = _linear(H, hq * D, qkv_b, ops), _linear(H, hkv * D, qkv_b, ops)
        attn.v_proj, attn.o_proj = _linear(H, hkv * D, qkv_b, ops), _linear(hq * D, H, o_b, ops)
        if fam.qk_norm:
            attn.q_norm, attn.k_norm = _rms_norm(D, eps, ops), _rms_norm(D, eps, ops)
        configure_attention(attn, cfg, i)
        attn._tik_ops = ops
        if moe_layer(cfg, i):
            mlp = build_moe_block(cfg, fam, ops)
        else:
            mlp = TikMLP()
            mlp.gate_proj, mlp.up_proj = _linear(H, inter, mlp_b, ops), _linear(H, inter, mlp_b, ops)
            mlp.down_proj, mlp._tik_ops = _linear(inter, H, mlp_b, ops), ops
        layer = DecoderLayer()
        layer.self_attn, layer.mlp = attn, mlp
        layer.input_layernorm, layer.post_attention_layernorm = _rms_norm(H, eps, ops), _rms_norm(H, eps, ops)
        model.layers.append(layer)
    model.norm = _rms_norm(H, eps, ops)
    model._tik_rope = RopeCache.of_config(cfg, ops.rope_table)
    return model
