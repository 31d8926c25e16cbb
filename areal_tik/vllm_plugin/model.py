"""tik causal LMs for vLLM: :class:`~areal_tik.vllm_plugin.causal_lm.TikCausalLM` (the one decoder
graph in vLLM's calling convention) with vLLM's ``Attention`` layer per decoder layer, which owns
the layer's paged KV cache and calls our CUSTOM backend. Single GPU (no tensor or pipeline
parallelism). Needs vLLM (0.24).

One class per model family, named by the family table's ``vllm_architecture``
(``TikQwen2ForCausalLM``, ...): vLLM's registry maps an architecture name to a class, and the
worker recognises a tik model by its class name. They are made on first access (module
``__getattr__``), so a family registered in ``layers/family.py`` needs no code here.
"""
from __future__ import annotations

from vllm.compilation.decorators import support_torch_compile
from vllm.config import CompilationMode, VllmConfig
from vllm.model_executor.layers.attention import Attention

from areal_tik.dispatch.opaque import opaque
from areal_tik.layers.precompile import step_token_bound
from areal_tik.vllm_plugin import ARCHITECTURES, process_ops, process_settings
from areal_tik.vllm_plugin import logprobs as tik_logprobs
from areal_tik.vllm_plugin.attention import TikAttentionBackend
from areal_tik.vllm_plugin.causal_lm import TikCausalLM

__all__ = ["TikForCausalLM"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0})
class TikForCausalLM(TikCausalLM):
    """Compiled only under vLLM's ``VLLM_COMPILE`` mode (``llm_kwargs(piecewise=True)``), with the ops of the
    forward opaque to the tracer (``dispatch/opaque.py``: the same implementations, the same bits); vLLM then
    splits the graph at its attention ops and captures the pieces between them as CUDA graphs, so steps that
    mix prefill and decode replay graphs too. Under ``mode=0`` (the default) nothing is compiled."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        if vllm_config.parallel_config.tensor_parallel_size != 1 or vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise NotImplementedError("tik vLLM models run on one GPU (tensor/pipeline parallel size 1)")
        if vllm_config.quant_config is not None:
            raise NotImplementedError("tik vLLM models run unquantised bf16 weights")
        ops = process_ops()
        if vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE:
            ops = opaque(ops)
        sched = vllm_config.scheduler_config
        tokens = (step_token_bound(sched.max_num_batched_tokens, sched.max_num_seqs)
                  if process_settings().precompile else 0)
        super().__init__(vllm_config.model_config.hf_config.get_text_config(), ops, precompile_tokens=tokens)
        base = _join(prefix, "model")
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            a.attn = Attention(a._tik_heads, a.head_dim, a.scaling, num_kv_heads=a._tik_kv_heads,
                               cache_config=vllm_config.cache_config, quant_config=None,
                               prefix=f"{base}.layers.{i}.self_attn.attn", attn_backend=TikAttentionBackend)
        tik_logprobs.install()     # this process samples from a tik model: our log-prob path


_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> type:
    """``TikQwen2ForCausalLM`` etc.: :class:`TikForCausalLM` under each family's vLLM architecture name."""
    if name not in ARCHITECTURES.values():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _CLASSES:
        _CLASSES[name] = type(name, (TikForCausalLM,), {"__module__": __name__, "__qualname__": name})
    return _CLASSES[name]
