"""The model families areal-tik runs: one entry per HF ``model_type`` holding every fact that
differs between them.

Every family runs the one decoder graph of ``layers/decoder.py``; what differs between Qwen2,
Qwen3 and Llama is data, kept here and nowhere else:

- ``qkv_bias``, ``o_bias``, ``mlp_bias``: whether the q/k/v projections, the output projection
  and the MLP's gate/up/down carry a bias: ``True``/``False``, or the name of the HF config flag
  that decides (Llama's ``attention_bias``, ``mlp_bias``);
- ``qk_norm``: an RMSNorm over each head of q and of k before RoPE (Qwen3's ``q_norm``/``k_norm``);
- ``rope_types``: the RoPE scalings a checkpoint of the family may carry (each one
  ``kernels/rope.rope_table`` builds);
- ``head_dim_in_config``: the HF config states ``head_dim``; otherwise it is implied by
  ``hidden_size / num_attention_heads`` and the presets leave it out (:func:`head_dim_of` reads
  either);
- ``config_defaults``: HF config fields a preset of the family sets (Qwen2's sliding window off);
- ``vllm_architecture``: the model class name the vLLM plugin registers for the family;
- ``moe``: the family's MLPs may be mixture-of-experts blocks (``layers/moe.py``): a router ``mlp.gate``
  (``weight [E, H]``) and routed experts ``mlp.experts`` (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``),
  on the layers :func:`moe_layer` names (the config's ``num_experts``, ``decoder_sparse_step``,
  ``mlp_only_layers``; the other layers keep the dense MLP of ``intermediate_size``);
- ``shared_expert``: an MoE block also has a dense ``mlp.shared_expert`` (``shared_expert_intermediate_size``)
  added through a sigmoid gate ``mlp.shared_expert_gate`` (Qwen2-MoE);
- ``presets``: named random-init shapes (``layers/models.py`` builds them; no downloads).

Whether the output embedding is tied to the input one is a fact of each checkpoint
(``tie_word_embeddings``), not of a family: :func:`tied_embeddings` reads it.

A new family is one :func:`register_family` call (the walk-through is docs/adding-a-family.md);
HF must know its ``model_type`` (its own modeling code, or a registered config/model pair).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Callable

__all__ = ["Family", "FAMILIES", "UnsupportedModelError", "register_family", "unregister_family", "family_of",
           "head_dim_of", "tied_embeddings", "moe_layer", "TableView"]


class UnsupportedModelError(ValueError):
    """A model or config the tik kernels cannot run (raised before anything is touched)."""


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    vllm_architecture: str
    qkv_bias: bool | str = False
    o_bias: bool | str = False
    mlp_bias: bool | str = False
    qk_norm: bool = False
    rope_types: tuple[str, ...] = ("default", "linear", "llama3")
    head_dim_in_config: bool = False
    moe: bool = False
    shared_expert: bool = False
    config_defaults: dict = dataclasses.field(default_factory=dict)
    presets: dict = dataclasses.field(default_factory=dict)

    def bias(self, cfg, part: str) -> bool:
        """Whether projection group ``part`` (``"qkv"``, ``"o"`` or ``"mlp"``) of ``cfg``'s model has a bias."""
        fact = getattr(self, f"{part}_bias")
        return bool(getattr(cfg, fact, False)) if isinstance(fact, str) else bool(fact)


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add ``family`` to the table (a ``model_type`` or preset name already taken raises ``ValueError``)."""
    if family.model_type in FAMILIES:
        raise ValueError(f"model family {family.model_type!r} is already registered")
    taken = {name for f in FAMILIES.values() for name in f.presets} & set(family.presets)
    if taken:
        raise ValueError(f"preset names already taken by another family: {sorted(taken)}")
    FAMILIES[family.model_type] = family
    return family


def unregister_family(model_type: str) -> None:
    """Remove a family (tests that register a throwaway one)."""
    FAMILIES.pop(model_type, None)


class TableView(Mapping):
    """A read-only mapping ``build()`` computes from the table at every access, so a family registered
    later shows in it (``models.PRESETS``, ``vllm_plugin.ARCHITECTURES``)."""

    def __init__(self, build: Callable[[], dict]):
        self._build = build

    def __getitem__(self, key):
        return self._build()[key]

    def __iter__(self):
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())


def family_of(cfg) -> Family:
    """The entry of ``cfg.model_type``; :class:`UnsupportedModelError` for any other type."""
    mt = getattr(cfg, "model_type", None)
    if mt not in FAMILIES:
        moe = (mt and "moe" in mt) or getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0)
        hint = " (a mixture-of-experts type without a family entry)" if moe else ""
        raise UnsupportedModelError(f"patch_model supports model_type {tuple(FAMILIES)}, got {mt!r}{hint}")
    return FAMILIES[mt]


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def moe_layer(cfg, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` of ``cfg``'s model has an MoE block in place of the dense MLP: a family with
    ``moe``, experts in the config, the layer not in ``mlp_only_layers``, and ``(layer_idx + 1)`` a multiple of
    ``decoder_sparse_step`` (HF's rule for Qwen2-MoE and Qwen3-MoE)."""
    fam = FAMILIES.get(getattr(cfg, "model_type", None))
    if fam is None or not fam.moe or not getattr(cfg, "num_experts", 0):
        return False
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return layer_idx not in (getattr(cfg, "mlp_only_layers", None) or []) and (layer_idx + 1) % step == 0


def tied_embeddings(cfg) -> bool:
    """Whether ``lm_head.weight`` is ``embed_tokens.weight`` (a checkpoint fact)."""
    return bool(getattr(cfg, "tie_word_embeddings", False))


_TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-6,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

register_family(Family(
    "qwen2", "TikQwen2ForCausalLM", qkv_bias=True, config_defaults={"use_sliding_window": False},
    presets={
        "tiny-qwen2": dict(**_TINY, rope_theta=10000.0),
        "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                             num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                             rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0,
                             bos_token_id=151643, eos_token_id=151645),
        "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                           num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                           rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0,
                           bos_token_id=151643, eos_token_id=151645),
    }))
register_family(Family(
    "qwen3", "TikQwen3ForCausalLM", qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True,
    head_dim_in_config=True,
    presets={"tiny-qwen3": dict(**{**_TINY, "num_attention_heads": 4}, rope_theta=10000.0)}))
register_family(Family(
    "llama", "TikLlamaForCausalLM", qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
    presets={"tiny-llama": dict(**_TINY, rope_theta=500000.0)}))

_TINY_MOE = dict(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                 mlp_only_layers=[])
_QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                      num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645)
register_family(Family(
    "qwen3_moe", "TikQwen3MoeForCausalLM", qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True,
    head_dim_in_config=True, moe=True,
    presets={"tiny-qwen3-moe": dict(**{**_TINY, "num_attention_heads": 4}, **_TINY_MOE, norm_topk_prob=True,
                                    rope_theta=10000.0),
             "qwen3-30b-a3b": _QWEN3_30B_A3B,
             "qwen3-30b-a3b-4l": {**_QWEN3_30B_A3B, "num_hidden_layers": 4}}))
register_family(Family(
    "qwen2_moe", "TikQwen2MoeForCausalLM", qkv_bias=True, moe=True, shared_expert=True,
    config_defaults={"use_sliding_window": False},
    presets={"tiny-qwen2-moe": dict(**_TINY, **_TINY_MOE, shared_expert_intermediate_size=128, norm_topk_prob=False,
                                    rope_theta=10000.0)}))
