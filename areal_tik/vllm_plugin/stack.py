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

then ``rms_norm`` and the ``lm_head`` GEMM (``ops.linear``).

Stacked projections: q/k/v are one GEMM over the stacked weight ``qkv_proj`` (rows q, then k,
then v) and gate/up one GEMM over ``gate_up_proj`` (rows gate, then up), followed by
``ops.silu_mul_packed``. The bits are those of the separate projections: ``ops.linear``
computes output element (m, n) from ``x[m]`` and weight row ``n`` alone, in one K order for
every tile shape (kernels/linear: "Invariance"), so a stacked GEMM's columns are the separate
GEMMs' outputs; ``silu_mul_packed`` is ``silu_mul`` on the halves. Fewer, larger launches per
layer (4 GEMMs instead of 7) is the only difference, and it matters at decode batch sizes.

:data:`STACKED` maps each HF parameter name suffix (``self_attn.q_proj.weight`` ...) to its
stacked parameter and row block; :meth:`TikDecoder.hf_named_parameters` gives the HF-named
views (weight digests, exports). No vLLM import here.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from areal_tik.layers.modules import RopeCache, TikLinear, TikRMSNorm
from areal_tik.layers.patch import rope_spec, validate_config

__all__ = ["check_config", "head_dim_of", "TikAttentionBlock", "TikDecoderLayer", "TikDecoder", "rms_norm_module",
           "AttendFn", "STACKED", "stacked_target", "load_hf_tensors"]

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
    """q/k/v as one stacked GEMM (``qkv_proj``), o_proj (+ Qwen3 q_norm/k_norm); RoPE by our table."""

    def __init__(self, cfg):
        super().__init__()
        D, hq, hkv, H = head_dim_of(cfg), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
        bias = _attention_bias(cfg)
        self.head_dim, self.num_heads, self.num_kv_heads = D, hq, hkv
        self.scaling = D ** -0.5
        self.qkv_rows = (hq * D, hkv * D, hkv * D)
        self.qkv_proj = _linear(H, sum(self.qkv_rows), bias)
        self.o_proj = _linear(hq * D, H, bool(getattr(cfg, "attention_bias", False)) and cfg.model_type != "qwen2")
        if cfg.model_type == "qwen3":
            self.q_norm = rms_norm_module(D, cfg.rms_norm_eps)
            self.k_norm = rms_norm_module(D, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: AttendFn) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_rows, dim=-1)      # row-strided views, unit last stride
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q.contiguous())
            k = self.k_norm(k.contiguous())
        q = self._tik_ops.apply_rope(q, cos, sin, positions)
        k = self._tik_ops.apply_rope(k, cos, sin, positions)
        out = attend(q, k, v)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class TikStackedMLP(nn.Module):
    """``down_proj(silu_mul_packed(gate_up_proj(x)))``: HF's gated MLP with gate/up stacked."""

    def __init__(self, cfg):
        super().__init__()
        self.gate_up_proj = _linear(cfg.hidden_size, 2 * cfg.intermediate_size, False)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._tik_ops.silu_mul_packed(self.gate_up_proj(x)))


# HF parameter suffix -> (stacked module suffix, index of the row block); blocks in this order
STACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


_UNSTACK: dict[str, list[str]] = {}
for _hf, (_st, _i) in STACKED.items():
    _UNSTACK.setdefault(_st, []).append(_hf)


def stacked_target(name: str) -> tuple[str, int] | None:
    """``model.layers.3.mlp.up_proj.weight`` -> (``model.layers.3.mlp.gate_up_proj.weight``, 1); None for a
    parameter that is not stacked."""
    head, _, leaf = name.rpartition(".")
    for hf, (stacked, idx) in STACKED.items():
        if head.endswith("." + hf) or head == hf:
            return f"{head[:len(head) - len(hf)]}{stacked}.{leaf}", idx
    return None


class TikDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = TikAttentionBlock(cfg)
        self.mlp = TikStackedMLP(cfg)
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
            if isinstance(m, (TikLinear, TikRMSNorm, TikStackedMLP, TikAttentionBlock)):
                m._tik_ops = ops

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, attends: list,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self._tik_rope.get(h.device)
        positions = positions.reshape(-1).long()
        for layer, attend in zip(self.layers, attends):
            h = layer(h, positions, cos, sin, attend)
        return self.norm(h)

    def row_blocks(self, param_name: str) -> list[int] | None:
        """Row sizes of the blocks stacked in ``param_name`` (a name of ``named_parameters()`` of this
        module, or of a parent that calls it ``model``), or None when it is not a stacked parameter."""
        head = param_name.rpartition(".")[0]
        if head.startswith("model."):
            head = head[len("model."):]
        for stacked in _UNSTACK:
            if head.endswith("." + stacked):
                mod = self.get_submodule(head)
                if isinstance(mod, TikLinear) and stacked.endswith("qkv_proj"):
                    return list(self.get_submodule(head.rpartition(".")[0]).qkv_rows)
                return [mod.out_features // 2] * 2
        return None

    def hf_named_parameters(self, prefix: str = "model"):
        """``(HF name, tensor)`` for every parameter as an HF checkpoint names it: each stacked
        parameter split (as views) into the HF projections it holds."""
        for name, p in self.named_parameters():
            full = f"{prefix}.{name}" if prefix else name
            head, _, leaf = full.rpartition(".")
            sizes = self.row_blocks(name)
            if sizes is None:
                yield full, p
                continue
            stacked = next(st for st in _UNSTACK if head.endswith("." + st))
            base = head[:len(head) - len(stacked)]
            for hf, part in zip(_UNSTACK[stacked], p.split(sizes, dim=0)):
                yield f"{base}{hf}.{leaf}", part


def load_hf_tensors(lm: nn.Module, weights, tied: bool) -> set[str]:
    """Copy HF-named tensors in place into ``lm`` (a module holding ``model``, a :class:`TikDecoder`,
    and ``lm_head``): q/k/v and gate/up into their row blocks of the stacked parameters, the rest by
    name; a tied ``lm_head`` and RoPE buffers skipped. Returns the parameter names written (a stacked
    one once any of its blocks is written). Unknown names or wrong shapes raise ``ValueError`` before
    anything of the offending tensor is written."""
    params = dict(lm.named_parameters())
    loaded: set[str] = set()
    unknown = []
    with torch.no_grad():
        for name, w in weights:
            if "rotary_emb.inv_freq" in name or (tied and name.startswith("lm_head.")):
                continue
            target, dst = name, params.get(name)
            st = stacked_target(name)
            if st is not None and st[0] in params:
                target = st[0]
                sizes = lm.model.row_blocks(target[len("model."):] if target.startswith("model.") else target)
                dst = params[target].narrow(0, sum(sizes[:st[1]]), sizes[st[1]])
            if dst is None:
                unknown.append(name)
                continue
            if dst.shape != w.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)} != model {tuple(dst.shape)}")
            dst.copy_(w)
            loaded.add(target)
    if unknown:
        raise ValueError(f"checkpoint tensors the tik model does not have: {unknown[:8]}"
                         f"{' ...' if len(unknown) > 8 else ''}")
    return loaded
