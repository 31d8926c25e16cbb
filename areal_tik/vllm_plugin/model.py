"""tik causal LMs for vLLM: ``stack.TikDecoder`` with vLLM's ``Attention`` layer per decoder
layer (which owns the layer's paged KV cache and calls our CUSTOM backend) and the
``lm_head`` GEMM by ``ops.linear``. Parameter names are HF's, so ``load_weights`` copies an
HF checkpoint's tensors by name (tied ``lm_head`` skipped). Single GPU (no tensor or
pipeline parallelism). Needs vLLM (0.24).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from areal_tik.layers.modules import TikLinear
from areal_tik.vllm_plugin import logprobs as tik_logprobs
from areal_tik.vllm_plugin import process_ops
from areal_tik.vllm_plugin.attention import TikAttentionBackend
from areal_tik.vllm_plugin.stack import TikDecoder, load_hf_tensors

__all__ = ["TikForCausalLM", "TikQwen2ForCausalLM", "TikQwen3ForCausalLM", "TikLlamaForCausalLM"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class TikForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        if vllm_config.parallel_config.tensor_parallel_size != 1 or vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise NotImplementedError("tik vLLM models run on one GPU (tensor/pipeline parallel size 1)")
        if vllm_config.quant_config is not None:
            raise NotImplementedError("tik vLLM models run unquantised bf16 weights")
        cfg = vllm_config.model_config.hf_config.get_text_config()
        self.config = cfg
        ops = process_ops()
        self.model = TikDecoder(cfg, ops)
        base = _join(prefix, "model")
        self._attn_layers = []
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            a.attn = Attention(a.num_heads, a.head_dim, a.scaling, num_kv_heads=a.num_kv_heads,
                               cache_config=vllm_config.cache_config, quant_config=None,
                               prefix=f"{base}.layers.{i}.self_attn.attn", attn_backend=TikAttentionBackend)
            self._attn_layers.append(a.attn)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = TikLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head._tik_ops = ops
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._attends = [self._attend_fn(a) for a in self._attn_layers]
        tik_logprobs.install()     # this process samples from a tik model: our log-prob path

    @staticmethod
    def _attend_fn(attn: Attention):
        def attend(q, k, v):
            return attn(q, k, v)      # [T, Hq*D]: stores K/V, attends over vLLM's paged cache
        return attend

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, self._attends, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)       # ops.linear: bf16 logits, rows batch-invariant

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in place (``stack.load_hf_tensors``: q/k/v and gate/up into their row
        blocks of the stacked parameters)."""
        return load_hf_tensors(self, weights, self.tied)

    def hf_named_parameters(self):
        """``(HF name, tensor)`` pairs of the weights as the trainer names them (stacked projections split
        into views; the tied ``lm_head`` once, as ``model.embed_tokens.weight``): what a weights digest
        of this model must hash to equal the trainer's."""
        yield from self.model.hf_named_parameters("model")
        if not self.tied:
            yield "lm_head.weight", self.lm_head.weight


class TikQwen2ForCausalLM(TikForCausalLM):
    pass


class TikQwen3ForCausalLM(TikForCausalLM):
    pass


class TikLlamaForCausalLM(TikForCausalLM):
    pass
