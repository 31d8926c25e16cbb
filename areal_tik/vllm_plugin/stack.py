"""The tik decoder on flattened tokens, with the attention step supplied by the caller.

This is the module graph of ``layers/modules.py`` (what ``patch_model(kernels="tik")``
runs for training and for our engine) written for vLLM's calling convention: tokens
flattened to ``[T]``, absolute ``positions`` ``[T]``, and the paged attention (KV store +
attention over the cache) done by a callable per layer, which vLLM's ``Attention`` layer
provides in ``model.py`` and tests provide without vLLM. Per layer, in this order and with
these rounding points (bf16 between ops):

    x = rms_norm(h); q, k, v = linear(x) (+ Qwen3 q_norm/k_norm per head);
    q, k = apply_rope(q/k, fp32 table, positions); a = attend(q, k, v);
    h = h + linear_o(a); h = h + down(silu_mul(gate(rms_norm(h)), up(rms_norm(h))))

then ``rms_norm`` and the ``lm_head`` GEMM (``ops.linear``). Parameter names are HF's
(``model.layers.N.self_attn.q_proj.weight`` ...), so an HF checkpoint's tensors load by name.
No vLLM import here.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from areal_tik.layers.modules import RopeCache, TikLinear, TikMLP, TikRMSNorm
from areal_tik.layers.patch import rope_spec, validate_config

__all__ = ["check_config", "head_dim_of", "TikAttentionBlock", "TikDecoderLayer", "TikDecoder", "rms_norm_module",
           "AttendFn"]

# attend(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D] (stores k/v, attends over the cache)
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def check_config(cfg) -> None:
    """Refuse configs the tik kernels do not run (``patch_model``'s rules)."""
    validate_config(cfg)


def _linear(n_in: int, n_out: int, bias: bool) -> TikLinear:
    lin = TikLinear(n_in, n_out, bias=bias)
    return lin


def rms_norm_module(dim: int, eps: float) -> TikRMSNorm:
    m = TikRMSNorm()
    m.weight = nn.Parameter(torch.ones(dim))
    m.variance_epsilon = eps
    return m


def _attention_bias(cfg) -> bool:
    if cfg.model_type == "qwen2":
        return True
    return bool(getattr(cfg, "attention_bias", False))


class TikAttentionBlock(nn.Module):
    """q/k/v/o projections (+ Qwen3 q_norm/k_norm) named as HF names them; RoPE by our table."""

    def __init__(self, cfg):
        super().__init__()
        D, hq, hkv, H = head_dim_of(cfg), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
        bias = _attention_bias(cfg)
        self.head_dim, self.num_heads, self.num_kv_heads = D, hq, hkv
        self.scaling = D ** -0.5
        self.q_proj = _linear(H, hq * D, bias)
        self.k_proj = _linear(H, hkv * D, bias)
        self.v_proj = _linear(H, hkv * D, bias)
        self.o_proj = _linear(hq * D, H, bool(getattr(cfg, "attention_bias", False)) and cfg.model_type != "qwen2")
        if cfg.model_type == "qwen3":
            self.q_norm = rms_norm_module(D, cfg.rms_norm_eps)
            self.k_norm = rms_norm_module(D, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: AttendFn) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = self._tik_ops.apply_rope(q, cos, sin, positions)
        k = self._tik_ops.apply_rope(k, cos, sin, positions)
        out = attend(q, k, v)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


def _mlp(cfg) -> TikMLP:
    m = TikMLP()
    m.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, False)
    m.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, False)
    m.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, False)
    return m


class TikDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = TikAttentionBlock(cfg)
        self.mlp = _mlp(cfg)
        self.input_layernorm = rms_norm_module(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = rms_norm_module(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, positions, cos, sin, attend: AttendFn):
        # modules.decoder_layer_forward, on [T, H]
        residual = h
        x = self.input_layernorm(h)
        x = self.self_attn(x, positions, cos, sin, attend)
        h = residual + x
        residual = h
        x = self.post_attention_layernorm(h)
        x = self.mlp(x)
        return residual + x


class TikDecoder(nn.Module):
    """``embed_tokens``, ``layers``, ``norm`` (HF's ``model.*`` names). ``forward`` gives the final
    normed hidden states ``[T, H]``; ``attends[i]`` is layer i's attention step."""

    def __init__(self, cfg, ops):
        """``ops``: the bound ops (``dispatch.bound.BoundOps``) every tik module of the stack calls."""
        super().__init__()
        check_config(cfg)
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([TikDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = rms_norm_module(cfg.hidden_size, cfg.rms_norm_eps)
        theta, scaling = rope_spec(cfg)
        self._tik_rope = RopeCache(head_dim_of(cfg), cfg.max_position_embeddings, theta, scaling, ops.rope_table)
        for m in self.modules():
            if isinstance(m, (TikLinear, TikRMSNorm, TikMLP, TikAttentionBlock)):
                m._tik_ops = ops

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, attends: list,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self._tik_rope.get(h.device)
        positions = positions.reshape(-1).long()
        for layer, attend in zip(self.layers, attends):
            h = layer(h, positions, cos, sin, attend)
        return self.norm(h)
