"""tik kernels inside vLLM, as a vLLM plugin (no fork).

vLLM finds ``register`` through the ``vllm.general_plugins`` entry point (setup.py) in every
process it starts, and the plugin adds:

- a model class per model family (``ModelRegistry.register_model``; the names are the family
  table's ``vllm_architecture``: ``TikQwen2ForCausalLM``, ``TikQwen3ForCausalLM``,
  ``TikLlamaForCausalLM``): the one decoder graph of ``layers/decoder.py`` (same modules, same
  ops, same rounding points, HF parameter names, so HF checkpoints load as they are), attention through
- an attention backend in vLLM's CUSTOM slot (``register_backend``) that runs
  ``ops.kv_cache_write`` + ``ops.attention_paged`` on vLLM's own paged KV cache
  (per layer ``[2, blocks, block_size, kv_heads, head_dim]``: each half is our page layout);
- the sampled tokens' log-probs from ``ops.logprobs_from_logits`` (the trainer's log-prob
  path) in place of vLLM's, in processes that built a tik model.

Pick the tik model for an HF checkpoint with :func:`llm_kwargs` (``hf_overrides``
architectures, the CUSTOM backend, decode-only full CUDA graphs without torch.compile, or with
``piecewise=True`` graphs for mixed steps too, through vLLM's compile with our ops opaque).

Nothing here imports vLLM at import time: ``import areal_tik`` never needs it, and
:func:`available` says whether the plugin can run and why not.
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
from collections.abc import Mapping

from areal_tik.dispatch.bound import bind
from areal_tik.layers.family import FAMILIES, TableView
from areal_tik.layers.moe import experts_synced
from areal_tik.settings import Settings

__all__ = ["VLLM_VERSION", "ARCHITECTURES", "available", "llm_kwargs", "architecture_for"]

VLLM_VERSION = "0.24.0"   # the vLLM the plugin is written and measured against


# model_type -> the architecture name the plugin registers
ARCHITECTURES: Mapping[str, str] = TableView(lambda: {mt: f.vllm_architecture for mt, f in FAMILIES.items()})


def process_settings() -> Settings:
    """This process's settings, read once from the environment (a vLLM worker's entry point is vLLM's)."""
    global _SETTINGS
    if _SETTINGS is None:
        _SETTINGS = Settings.from_env()
    return _SETTINGS


def process_ops():
    """The tik ops of this process, bound once (``Settings.backend`` from ``AREAL_TIK_BACKEND``): a vLLM
    worker builds the model, the attention backend and the sampler hook from the same selection."""
    global _OPS
    if _OPS is None:
        _OPS = bind(process_settings().backend)
    return _OPS


_OPS = None
_SETTINGS = None


def available() -> tuple[bool, str]:
    """(usable, reason): vLLM importable at the version the plugin targets."""
    if importlib.util.find_spec("vllm") is None:
        return False, "vllm is not installed (pip install 'areal-tik[vllm]')"
    try:
        ver = md.version("vllm")
    except md.PackageNotFoundError:
        ver = None
    if ver is None:
        return True, "vllm importable (version unknown: no package metadata)"
    if not ver.startswith(VLLM_VERSION.rsplit(".", 1)[0] + "."):
        return False, f"vllm {ver} installed; the tik plugin is written for vllm {VLLM_VERSION}"
    return True, f"vllm {ver}"


def architecture_for(model_type: str) -> str:
    if model_type not in ARCHITECTURES:
        raise ValueError(f"tik vLLM models exist for model_type {sorted(ARCHITECTURES)}, got {model_type!r}")
    return ARCHITECTURES[model_type]


def llm_kwargs(model_type: str, block_size: int = 64, ops=None, piecewise: bool = False,
               graph_tokens: int | None = None) -> dict:
    """Keyword arguments for ``vllm.LLM(model=dir, **llm_kwargs(cfg.model_type))`` that run the
    checkpoint on tik kernels: the tik architecture, the CUSTOM attention backend and CUDA graphs:

    - default: full graphs for pure-decode batches, every other step eager, no torch.compile;
    - ``piecewise``: also graphs for steps that mix prefill and decode, as stock vLLM runs them: vLLM's
      ``VLLM_COMPILE`` mode traces the model with our ops opaque (``dispatch/opaque.py``) and its ``eager``
      backend (no Inductor: nothing rewrites the graph between our ops), splits it at the attention ops and
      captures the pieces (``FULL_AND_PIECEWISE``; decode batches keep their full graphs). ``graph_tokens``: the
      largest step, in tokens, that runs as a graph (vLLM's ``max_cudagraph_capture_size``; its default is
      ``min(2 * max_num_seqs, 512)``, and a longer mixed step runs eagerly).

    A family with MoE blocks gets graphs only when the experts op bound in this process (``ops``, default
    :func:`process_ops`: the workers bind the same) never waits on the host (the triton backend's), else none
    and no compile (``layers/moe.py``, ``host_synced``)."""
    arch = architecture_for(model_type)
    synced = FAMILIES[model_type].moe and experts_synced(ops if ops is not None else process_ops())
    if graph_tokens is not None and (not piecewise or int(graph_tokens) < 1):
        raise ValueError(f"graph_tokens={graph_tokens!r} needs piecewise=True and a value >= 1")
    if synced and piecewise:
        raise ValueError(f"piecewise graphs need an experts op that never waits on the host; {model_type} binds "
                         f"moe_experts to a host-synced implementation (bind moe_experts=triton)")
    if synced:
        compilation = {"mode": 0, "cudagraph_mode": "NONE"}
    elif piecewise:
        compilation = {"mode": 3, "backend": "eager", "cudagraph_mode": "FULL_AND_PIECEWISE"}
        if graph_tokens is not None:
            compilation["max_cudagraph_capture_size"] = int(graph_tokens)
    else:
        compilation = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    return dict(hf_overrides={"architectures": [arch]}, attention_backend="CUSTOM",
                block_size=block_size, compilation_config=compilation)
