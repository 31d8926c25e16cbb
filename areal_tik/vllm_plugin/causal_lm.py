"""The vLLM plugin's causal LM without vLLM: the one decoder graph (``layers/decoder.py``) in vLLM's
calling convention. No vLLM import here; ``model.py`` adds vLLM's ``Attention`` layers, and CPU
tests put a stand-in in their place.

- Modules: :func:`~areal_tik.layers.decoder.build_decoder` builds the family's decoder (HF
  parameter names, the family table's biases and q/k norms) and ``lm_head`` is a ``TikLinear``
  (tied to ``embed_tokens`` when the checkpoint ties them). q/k/v and gate/up are stacked into
  one GEMM each, as in our engine (``layers/stacking.py``: the separate GEMMs' bits, views under
  the HF names).
- Forward: tokens flattened to ``[T]`` with absolute ``positions`` ``[T]``; the step applies RoPE
  from the fp32 table (``steps.TikRope``) and attends through each layer's ``self_attn.attn``
  (vLLM's ``Attention``: stores K/V in vLLM's paged cache and runs our CUSTOM backend).
- Weights: an HF checkpoint's tensors are copied by name into the parameters (the stacked
  tensors behind them are written through the views). MoE experts load under either name form: the fused
  ``mlp.experts.gate_up_proj`` / ``down_proj`` of a transformers 5 model's state dict (what weight updates
  send), or the per-expert ``mlp.experts.<e>.{gate,up,down}_proj.weight`` of a checkpoint file (how
  ``save_pretrained`` writes them and the released checkpoints hold them), written into their slices.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from areal_tik.layers.decoder import build_decoder, decoder_forward, embed
from areal_tik.layers.family import tied_embeddings
from areal_tik.layers.modules import TikLinear
from areal_tik.layers.moe import WritableTensors
from areal_tik.layers.precompile import precompile_linears
from areal_tik.layers.stacking import stack_projections
from areal_tik.layers.steps import TikRope

__all__ = ["TikCausalLM", "LayerAttentionStep", "load_hf_tensors"]


@dataclasses.dataclass
class LayerAttentionStep(TikRope):
    """tik RoPE, then the attention layer each decoder layer holds as ``self_attn.attn`` (``[T, Hq*D]`` out)."""

    def attend(self, attn, q, k, v) -> torch.Tensor:
        return attn.attn(q, k, v)


class TikCausalLM(nn.Module):
    """``model`` (the family's decoder) and ``lm_head``, HF names; every tik module on ``ops``."""

    def __init__(self, cfg, ops, precompile_tokens: int = 0):
        super().__init__()
        # the first weight load compiles every linear tile config a step of up to this many tokens can pick
        # (``layers/precompile.py``; 0: none), so that no rollout step pays a JIT compile
        self._tik_precompile_tokens = int(precompile_tokens)
        self.config = cfg
        self.model = build_decoder(cfg, ops)
        self.tied = tied_embeddings(cfg)
        self.lm_head = TikLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head._tik_ops = ops
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._tik_ops = ops
        stack_projections(self.model)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        h = embed(self.model, input_ids, inputs_embeds)
        cos, sin = self.model._tik_rope.get(h.device)
        return decoder_forward(self.model, h, LayerAttentionStep(self._tik_ops, cos, sin, positions.reshape(-1).long()))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)       # ops.linear: bf16 logits, rows batch-invariant

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in place (:func:`load_hf_tensors`); the RoPE table is built on the weights' device
        here, before any forward (a compiled forward must find it, not trace its construction), and on the first
        load the linear tile configs are compiled (``precompile_tokens``)."""
        loaded = load_hf_tensors(self, weights)
        self.model._tik_rope.get(self.model.embed_tokens.weight.device)
        if self._tik_precompile_tokens:
            precompile_linears(self, max_tokens=self._tik_precompile_tokens)   # once per process; no-op off CUDA
            self._tik_precompile_tokens = 0
            if torch.cuda.is_available():
                torch.cuda.empty_cache()    # its dummy operands' blocks back before vLLM measures free memory
        return loaded

    def hf_named_parameters(self):
        """``(HF name, tensor)`` pairs of the weights as the trainer names them (the tied ``lm_head`` once, as
        ``model.embed_tokens.weight``; no attention-layer state): what a weights digest of this model must hash
        to equal the trainer's."""
        for name, p in self.named_parameters():
            if ".self_attn.attn." not in name:
                yield name, p


def load_hf_tensors(lm: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy HF-named tensors in place into ``lm``'s parameters of the same names (a tied ``lm_head`` and RoPE
    buffers skipped; per-expert MoE names into their slices of the fused parameters). Returns the parameter
    names written (a fused expert parameter once every expert's piece of it was). Unknown names or wrong shapes
    raise ``ValueError`` before anything of the offending tensor is written."""
    params = dict(lm.named_parameters())
    table = WritableTensors(params)
    loaded: set[str] = set()
    pieces: dict[str, set] = {}
    unknown = []
    with torch.no_grad():
        for name, w in weights:
            if "rotary_emb.inv_freq" in name or (lm.tied and name.startswith("lm_head.")):
                continue
            hit = table.lookup(name)
            if hit is None:
                unknown.append(name)
                continue
            owner, dst = hit
            if dst.shape != w.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)} != model {tuple(dst.shape)}")
            dst.copy_(w)
            if owner == name:
                loaded.add(name)
            else:
                pieces.setdefault(owner, set()).add(name)
    for fused, got in pieces.items():
        if len(got) == params[fused].shape[0] * (1 if fused.endswith("down_proj") else 2):
            loaded.add(fused)
    if unknown:
        raise ValueError(f"checkpoint tensors the tik model does not have: {unknown[:8]}"
                         f"{' ...' if len(unknown) > 8 else ''}")
    return loaded
