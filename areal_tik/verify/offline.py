"""In-process generation through a rollout engine on an HF checkpoint, for the parity checks and the rollout
benchmark: :class:`OurEngine` (``LLMEngine`` on the patched model) and :class:`VLLMEngine` (``vllm.LLM``, with the
tik plugin's engine arguments when ``kernels="tik"``). Each rollout engine of the registry
(``areal_tik.areal.engines``) names its class here as its ``offline`` hook.

``generate(prompts, max_new, seeds=None, arrivals=0, temperature=1.0)`` returns ``(prompt ids, output ids, output
log-probs)`` per prompt, in prompt order, every sampled token's log-prob recorded and EOS ignored: every prompt at
once, or ``arrivals`` new requests per engine step (as a server receiving requests while it decodes: steps mix
prefill and decode). ``seeds``: one per prompt, or None (the engine draws them).
"""
from __future__ import annotations

import json
import os
import time

from areal_tik import vllm_plugin
from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
from areal_tik.layers.models import build_model
from areal_tik.layers.patch import patch_model
from areal_tik.vllm_plugin import preset_loader

__all__ = ["staggered", "OurEngine", "VLLMEngine"]


def staggered(prompts, params, arrivals: int, add, step, unfinished) -> list:
    """Drive an engine with ``arrivals`` new requests per step until all are done: ``add(rid, prompt, params)``,
    ``step()`` -> [(rid, finished output)], ``unfinished()``. The outputs in prompt order."""
    rids = [f"arr-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    queue, done = list(zip(rids, prompts, params)), {}
    while queue or unfinished():
        for req in queue[:arrivals]:
            add(*req)
        queue = queue[arrivals:]
        done.update(step())
    return [done[r] for r in rids]


def _seeds(seeds, n: int) -> list:
    return list(seeds) if seeds is not None else [None] * n


class OurEngine:
    """``LLMEngine`` on ``model_dir`` patched with ``kernels`` (and ``backend``: ``Settings.backend``);
    ``weights_preset``: build that preset (seeded random weights) instead of reading ``model_dir``;
    ``engine_config``: :class:`EngineConfig` fields."""

    def __init__(self, model_dir: str, kernels: str = "tik", backend: str | None = None, device=None,
                 weights_preset: str | None = None, **engine_config):
        model = patch_model(build_model(weights_preset or model_dir, device=device), kernels=kernels, backend=backend)
        self.engine = LLMEngine(model, EngineConfig(**engine_config))

    def generate(self, prompts, max_new: int, seeds=None, arrivals: int = 0, temperature: float = 1.0) -> list:
        params = [SamplingParams(temperature=temperature, max_new_tokens=max_new, ignore_eos=True, seed=s)
                  for s in _seeds(seeds, len(prompts))]
        eng = self.engine
        if not arrivals:
            outs = eng.generate(prompts, params)
        else:
            outs = staggered(prompts, params, arrivals, add=eng.add_request,
                             step=lambda: [(o.request_id, o) for o in eng.step()], unfinished=eng.has_unfinished)
        return [(list(o.prompt_ids), list(o.output_ids), list(o.output_logprobs)) for o in outs]

    def stats(self) -> dict:
        return self.engine.stats()


class VLLMEngine:
    """``vllm.LLM`` on ``model_dir`` (bf16, no tokenizer); ``kernels="tik"`` adds the tik plugin's engine
    arguments (``vllm_plugin.llm_kwargs``; ``piecewise``: graphs for mixed steps too, up to ``graph_tokens``),
    ``"default"`` is stock vLLM. ``block_size``: the KV page size (the plugin's default when None);
    ``weights_preset``: fill the model with that preset's seeded weights (the plugin's ``tik_preset`` load format;
    ``model_dir`` then needs only ``config.json``); ``logprobs``: False asks vLLM for no log-probs (``record``
    returns an empty list); ``llm_kwargs``: more ``vllm.LLM`` arguments; ``overrides``: ``vllm.LLM`` arguments
    applied after the plugin's (a probe of another compilation config). Needs vLLM 0.24 and the plugin's entry
    point (``pip install 'areal-tik[vllm]'``)."""

    def __init__(self, model_dir: str, kernels: str = "tik", block_size: int | None = None,
                 weights_preset: str | None = None, logprobs: bool = True, piecewise: bool = False,
                 graph_tokens: int | None = None, overrides: dict | None = None, **llm_kwargs):
        from vllm import LLM   # vLLM is optional: imported only when this engine runs
        with open(os.path.join(model_dir, "config.json")) as f:
            model_type = json.load(f)["model_type"]
        kw = dict(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", **llm_kwargs)
        page = {} if block_size is None else {"block_size": block_size}
        kw.update(vllm_plugin.llm_kwargs(model_type, piecewise=piecewise, graph_tokens=graph_tokens, **page)
                  if kernels == "tik" else page)
        if weights_preset:
            kw.update(preset_loader.llm_kwargs(weights_preset))
        kw.update(overrides or {})
        self.kwargs, self.logprobs = kw, logprobs
        self.llm = LLM(**kw)

    def sampling(self, max_new: int, seed: int | None = None, temperature: float = 1.0):
        """vLLM's sampling parameters for one request: unfiltered, EOS ignored, the sampled token's log-prob
        (none without ``logprobs``)."""
        from vllm import SamplingParams as VLLMSamplingParams   # optional dependency, as above
        return VLLMSamplingParams(temperature=temperature, top_p=1.0, top_k=-1, max_tokens=max_new, ignore_eos=True,
                                  logprobs=0 if self.logprobs else None, detokenize=False, seed=seed)

    @staticmethod
    def record(out) -> tuple[list[int], list[int], list[float]]:
        """(prompt ids, output ids, the sampled tokens' log-probs, empty when none were asked for) of one
        finished vLLM request."""
        c = out.outputs[0]
        toks = list(c.token_ids)
        return list(out.prompt_token_ids), toks, [d[t].logprob for d, t in zip(c.logprobs or [], toks)]

    def generate(self, prompts, max_new: int, seeds=None, arrivals: int = 0, temperature: float = 1.0) -> list:
        params = [self.sampling(max_new, s, temperature) for s in _seeds(seeds, len(prompts))]
        if not arrivals:
            outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [self.record(o) for o in outs]
        eng = self.llm.llm_engine
        return staggered(prompts, params, arrivals,
                         add=lambda rid, p, sp: eng.add_request(rid, {"prompt_token_ids": p}, sp),
                         step=lambda: [(o.request_id, self.record(o)) for o in eng.step() if o.finished],
                         unfinished=eng.has_unfinished_requests)
